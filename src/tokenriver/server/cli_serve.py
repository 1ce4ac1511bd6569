"""`tokenriver serve` and `tokenriver visualize`: the server's subcommands, registered on the CLI's parser.

The CLI sits above the server, so this module cannot import it: the CLI hands
over its engine-flag builder and its EngineConfig reader instead, and engine
flags stay defined in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from functools import partial

from tokenriver.config import EngineConfig
from tokenriver.server.config import ServerConfig

API_KEY_ENV = "TOKENRIVER_API_KEY"

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerConfig)}


def add_serve_command(subparsers: argparse._SubParsersAction,
                      add_engine_flags: Callable[[argparse.ArgumentParser], None],
                      engine_config_from: Callable[[argparse.Namespace], EngineConfig]) -> None:
    """Register `serve` and `visualize`; each parser's `handler(args) -> int` runs the server."""
    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve the model over an OpenAI-compatible HTTP API until SIGTERM or Ctrl-C.",
        epilog="Example:\n  tokenriver serve --port 8000 --api-key secret\n"
               "  curl localhost:8000/v1/completions -H 'Authorization: Bearer secret' "
               "-H 'Content-Type: application/json' -d '{\"prompt\": \"Hello\", \"max_tokens\": 16}'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    visualize = subparsers.add_parser(
        "visualize", help="serve, then open the visualizer (why each token was chosen) in a browser",
        description="Start the server and print (and try to open) the visualizer's URL.")
    visualize.add_argument("--no-browser", action="store_true", help="print the URL without opening a browser")
    for parser, open_visualizer in ((serve, False), (visualize, True)):
        _add_server_flags(parser)
        add_engine_flags(parser)
        parser.set_defaults(handler=partial(_run, engine_config_from=engine_config_from,
                                            open_visualizer=open_visualizer))


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default=_DEFAULTS["host"],
                       help="interface to listen on; 0.0.0.0 exposes the server to the network (default: %(default)s)")
    group.add_argument("--port", type=int, default=_DEFAULTS["port"],
                       help="TCP port; 0 picks a free one (default: %(default)s)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                            f"(default: ${API_KEY_ENV}, else no key)")
    group.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the model file's stem)")
    group.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                       help="allow browser requests from ORIGIN (repeatable or comma-separated; '*' = any); "
                            "CORS is off without it")
    group.add_argument("--max-body-size", default=_DEFAULTS["max_body_size"],
                       help=f"largest request body, e.g. 512KiB; bigger gets 413 "
                            f"(default: {_DEFAULTS['max_body_size'] / 2**20:g}MiB)")
    group.add_argument("--shutdown-timeout", type=float, default=_DEFAULTS["shutdown_timeout"],
                       help="seconds SIGTERM waits for running requests (default: %(default)s)")
    group.add_argument("--log-level", default=_DEFAULTS["log_level"], choices=["debug", "info", "warning", "error"],
                       help="(default: %(default)s)")


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    origins = tuple(origin.strip() for value in (args.allowed_origins or []) for origin in value.split(",")
                    if origin.strip())
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        served_model_name=args.served_model_name, allowed_origins=origins,
                        max_body_size=args.max_body_size, shutdown_timeout=args.shutdown_timeout,
                        log_level=args.log_level)


def _run(args: argparse.Namespace, *, engine_config_from: Callable[[argparse.Namespace], EngineConfig],
         open_visualizer: bool) -> int:
    from tokenriver.server.serve import run_server

    return run_server(engine_config_from(args), server_config_from(args),
                      visualizer=open_visualizer, open_browser=open_visualizer and not args.no_browser)
