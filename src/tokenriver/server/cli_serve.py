"""`tokenriver serve` and `tokenriver visualize`: the server's subcommands, registered on the CLI's parser.

The CLI sits above the server, so this module cannot import it: the CLI hands
over its engine-flag builder and its EngineConfig reader instead. Both the
engine's and the server's flags are generated from their config fields
(flags.py), so each flag is defined once.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial

from tokenriver.config import EngineConfig
from tokenriver.flags import add_flags, collect
from tokenriver.server.config import ServerConfig

API_KEY_ENV = "TOKENRIVER_API_KEY"


def add_serve_command(
    subparsers: argparse._SubParsersAction,
    add_engine_flags: Callable[[argparse.ArgumentParser], None],
    engine_config_from: Callable[[argparse.Namespace], EngineConfig],
) -> None:
    """Register `serve` and `visualize`; each parser's `handler(args) -> int` runs the server."""
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve the model over an OpenAI-compatible HTTP API until SIGTERM or Ctrl-C.",
        epilog="Example:\n  tokenriver serve --port 8000 --api-key secret\n"
        "  curl localhost:8000/v1/completions -H 'Authorization: Bearer secret' "
        '-H \'Content-Type: application/json\' -d \'{"prompt": "Hello", "max_tokens": 16}\'',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    visualize = subparsers.add_parser(
        "visualize",
        help="serve, then open the visualizer (why each token was chosen) in a browser",
        description="Start the server and print (and try to open) the visualizer's URL.",
    )
    visualize.add_argument("--no-browser", action="store_true", help="print the URL without opening a browser")
    for parser, open_visualizer in ((serve, False), (visualize, True)):
        _add_server_flags(parser)
        add_engine_flags(parser)
        parser.set_defaults(
            handler=partial(_run, engine_config_from=engine_config_from, open_visualizer=open_visualizer)
        )


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ServerConfig, "server_", "server options")


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    values = collect(args, "server_")
    values["allowed_origins"] = tuple(
        origin.strip() for value in values.get("allowed_origins", []) for origin in value.split(",") if origin.strip()
    )
    values["api_key"] = values.get("api_key") or os.environ.get(API_KEY_ENV) or None
    return ServerConfig(**values)


def _run(
    args: argparse.Namespace, *, engine_config_from: Callable[[argparse.Namespace], EngineConfig], open_visualizer: bool
) -> int:
    from tokenriver.server.serve import run_server

    return run_server(
        engine_config_from(args),
        server_config_from(args),
        visualizer=open_visualizer,
        open_browser=open_visualizer and not args.no_browser,
    )
