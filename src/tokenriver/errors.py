"""Error types every entry point raises.

Each error names what is wrong and how to fix it; `param` names the offending
field so the HTTP layer can map it onto OpenAI's error body in one place.
Stdlib only: this module sits at the bottom of the import graph.
"""

from __future__ import annotations


class TokenriverError(Exception):
    """Base of every error tokenriver raises on purpose."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidParameterError(TokenriverError, ValueError):
    """A value the user gave is out of range or of the wrong kind."""


class DuplicateRequestIdError(InvalidParameterError):
    """A request id that an unfinished request already has. Ids are unique among unfinished requests: the engine
    checks a caller's id, the scheduler the ids of the engine requests made from it (n > 1: "<id>#<i>")."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"request id {request_id!r} is already in use by an unfinished request; use a unique id",
            param="request_id",
        )
        self.request_id = request_id


class ContextLengthError(InvalidParameterError):
    """A prompt (plus what must be generated) does not fit the model or the KV pool."""

    def __init__(self, message: str, *, num_tokens: int, max_tokens: int, param: str | None = "prompt") -> None:
        super().__init__(message, param=param)
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class ModelLoadError(TokenriverError):
    """A model file or folder is missing, damaged, or of a kind tokenriver cannot run."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message, param="model")
        self.path = path


class RequestNotFoundError(TokenriverError, KeyError):
    """An operation named a request id the engine does not know."""

    def __str__(self) -> str:
        return self.message


class EngineDeadError(TokenriverError):
    """The engine loop stopped after an internal failure; no new request can run."""


class EngineOverloadedError(TokenriverError):
    """The waiting queue is full (SchedulerConfig.max_waiting_requests): try again once running requests finish."""
