"""ServerConfig: how the HTTP server listens and guards itself, frozen and validated once.

The engine's knobs live in EngineConfig; this holds only what the HTTP layer
needs. `tokenriver serve` builds one from its flags (generated from the fields'
metadata, as the engine's are) and TOKENRIVER_API_KEY;
`build_app` and `run_server` read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenriver.config import parse_size
from tokenriver.errors import InvalidParameterError
from tokenriver.flags import option

DEFAULT_MAX_BODY_SIZE = 4 * 1024**2


@dataclass(frozen=True)
class ServerConfig:
    """Listening address, access control and limits of the OpenAI-compatible server."""

    # Interface to bind; 127.0.0.1 keeps the server local, 0.0.0.0 exposes it to the network.
    host: str = option("127.0.0.1", "interface to listen on; 0.0.0.0 exposes the server to the network", metavar="HOST")
    # TCP port; 0 lets the OS pick a free one (the startup log prints it).
    port: int = option(8000, "TCP port; 0 picks a free one", metavar="PORT")
    # Clients must send "Authorization: Bearer <api_key>" on /v1/*, /tokenize and /detokenize; None = no key.
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize (default: $TOKENRIVER_API_KEY, "
        "else no key)",
        metavar="KEY",
    )
    # The model name clients send and /v1/models lists; None = the model file's stem.
    served_model_name: str | None = option(
        None, "the model name clients send (default: the model file's stem)", metavar="NAME"
    )
    # Origins allowed by CORS (e.g. "http://localhost:3000", or "*"); empty = CORS off.
    allowed_origins: tuple[str, ...] = option(
        (),
        "allow browser requests from ORIGIN (repeatable or comma-separated; '*' = any); CORS is off without it",
        metavar="ORIGIN",
    )
    # Largest request body in bytes; a bigger one gets 413 before it is read.
    max_body_size: int = option(
        DEFAULT_MAX_BODY_SIZE,
        "largest request body, e.g. 512KiB; bigger gets 413 (default: 4MiB)",
        metavar="SIZE",
        type=str,
    )
    # Responses kept for previous_response_id and GET /v1/responses/{id} (only those sent with store: true), least
    # recently used dropped first; 0 = none (store: true is then refused).
    responses_store_size: int = option(
        100, "Responses API: responses kept for previous_response_id (store: true); 0 = none", metavar="N"
    )
    # Seconds a SIGTERM waits for running requests before cancelling them.
    shutdown_timeout: float = option(30.0, "seconds SIGTERM waits for running requests", metavar="SECONDS")
    # Folder served at / and /static/; None = the visualizer shipped in tokenriver/visualizer/static.
    static_dir: str | None = None
    # uvicorn and tokenriver log level: debug, info, warning or error.
    log_level: str = option("info", "uvicorn and tokenriver log level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidParameterError(
                f"port={self.port!r} must be an integer in [0, 65535] (0 = any free port)", param="port"
            )
        if self.api_key is not None and not self.api_key:
            raise InvalidParameterError(
                "api_key is empty: give a non-empty key, or none to turn auth off", param="api_key"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise InvalidParameterError(
                "served_model_name is empty: give a name, or none for the file's stem", param="served_model_name"
            )
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        object.__setattr__(self, "max_body_size", _parse_body_size(self.max_body_size))
        if self.max_body_size < 1024:
            raise InvalidParameterError(
                f"max_body_size={self.max_body_size} bytes is too small for any request: give at least 1KiB, e.g. 4MiB",
                param="max_body_size",
            )
        if not isinstance(self.shutdown_timeout, (int, float)) or self.shutdown_timeout < 0:
            raise InvalidParameterError(
                f"shutdown_timeout={self.shutdown_timeout!r} must be a number of seconds >= 0", param="shutdown_timeout"
            )
        if not isinstance(self.responses_store_size, int) or self.responses_store_size < 0:
            raise InvalidParameterError(
                f"responses_store_size={self.responses_store_size!r} must be an integer >= 0 (0 = keep none)",
                param="responses_store_size",
            )
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise InvalidParameterError(
                f"log_level={self.log_level!r} must be one of debug, info, warning, error", param="log_level"
            )


def _parse_body_size(value: str | int) -> int:
    """parse_size names kv_cache_memory in its errors; here the field is max_body_size."""
    try:
        return parse_size(value)
    except InvalidParameterError:
        raise InvalidParameterError(
            f"max_body_size={value!r} is not a size: write bytes or a number with a unit, e.g. 4MiB or 512KiB",
            param="max_body_size",
        ) from None
