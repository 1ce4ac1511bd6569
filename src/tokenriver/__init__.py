"""tokenriver: a readable LLM inference engine that shows how generation happens.

Importing the package imports nothing else: each public name is imported on first use (PEP 562's module
__getattr__), so `import tokenriver.sched.scheduler` stays plain Python, without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name → the module that defines it.
_EXPORTS = {
    "LLM": "tokenriver.engine.llm",
    "AsyncEngine": "tokenriver.engine.async_engine",
    "SamplingParams": "tokenriver.params",
    "StructuredOutput": "tokenriver.params",
    "RequestOutput": "tokenriver.outputs",
    "CompletionOutput": "tokenriver.outputs",
    "FinishReason": "tokenriver.outputs",
    "EngineConfig": "tokenriver.config",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "SamplingParams",
    "StructuredOutput",
    "RequestOutput",
    "CompletionOutput",
    "FinishReason",
    "EngineConfig",
    "__version__",
]

if TYPE_CHECKING:
    from tokenriver.config import EngineConfig
    from tokenriver.engine.async_engine import AsyncEngine
    from tokenriver.engine.llm import LLM
    from tokenriver.outputs import CompletionOutput, FinishReason, RequestOutput
    from tokenriver.params import SamplingParams, StructuredOutput


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenriver' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
