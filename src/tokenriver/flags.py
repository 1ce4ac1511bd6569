"""Command-line flags generated from a config dataclass's fields.

Each field's metadata holds its help text and, where the defaults would read badly, its flag name, metavar,
choices or argparse type (`option()` writes that metadata). The engine's flags (EngineConfig and its parts, on
every command), the sampling flags (SamplingParams, on `generate` and `chat`) and the server's (ServerConfig, on
`serve` and `visualize`) are all generated here, so a field, its help and its flag are defined once. Stdlib only.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    type: Callable[[str], Any] | None = None,
) -> Any:
    """A dataclass field with a command-line flag: its help text, and the flag name (default: the field's name
    with dashes), metavar (default: the name in capitals), choices or argparse type where the default would not
    do. A field without help gets no flag."""
    return dataclasses.field(default=default, metadata=_metadata(help, flag, metavar, choices, type))


def list_option(help: str, *, flag: str | None = None, metavar: str | None = None) -> Any:
    """option() for a list field: each instance starts with its own empty list (a dataclass takes no shared
    mutable default); the flag is repeatable."""
    return dataclasses.field(default_factory=list, metadata=_metadata(help, flag, metavar, None, None))


def _metadata(
    help: str,
    flag: str | None,
    metavar: str | None,
    choices: tuple[str, ...] | None,
    type: Callable[[str], Any] | None,
) -> dict[str, Any]:
    metadata = {"help": help, "flag": flag, "metavar": metavar, "choices": choices, "type": type}
    return {k: v for k, v in metadata.items() if v is not None}


def token_bias(text: str) -> tuple[int, float]:
    """'1234:-100' → (1234, -100.0): one logit_bias entry as the command line writes it."""
    try:
        token_id, bias = text.split(":")
        return int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKEN_ID:BIAS, e.g. 1234:-100") from None


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    dest_prefix: str,
    title: str,
    *,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One flag per field of cls that has help in its metadata, typed from the field's annotation; values land in
    args as dest_prefix + field name. defaults: where a command's default differs from the field's."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        help_text = f.metadata.get("help")
        if help_text is None:
            continue
        flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
        dest = dest_prefix + f.name
        default = (defaults or {}).get(
            f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory()
        )
        if default is not None and default != () and "(default:" not in help_text:
            help_text += f" (default: {default})"
        help_text = help_text.replace("%", "%%")
        metavar = f.metadata.get("metavar", f.name.upper())
        annotation = str(f.type)
        if annotation in ("bool", "bool | None"):
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif annotation.startswith(("list[str]", "tuple[str, ...]")):
            group.add_argument(flag, dest=dest, action="append", default=None, metavar=metavar, help=help_text)
        elif annotation.startswith("list[int]"):
            group.add_argument(flag, dest=dest, type=int, nargs="+", default=None, metavar=metavar, help=help_text)
        elif annotation.startswith("dict[int, float]"):
            group.add_argument(
                flag, dest=dest, type=token_bias, action="append", default=None, metavar=metavar, help=help_text
            )
        else:
            kind = f.metadata.get("type") or (
                int if annotation.startswith("int") else float if annotation.startswith("float") else str
            )
            choices = f.metadata.get("choices")
            group.add_argument(
                flag,
                dest=dest,
                type=kind,
                default=default,
                choices=choices,
                metavar=None if choices else metavar,
                help=help_text,
            )


def collect(args: argparse.Namespace, dest_prefix: str) -> dict[str, Any]:
    """The flags add_flags made with dest_prefix that were given (or have a default), by field name."""
    values = {k[len(dest_prefix) :]: v for k, v in vars(args).items() if k.startswith(dest_prefix) and v is not None}
    if isinstance(values.get("logit_bias"), list):
        values["logit_bias"] = dict(values["logit_bias"])
    return values
