"""tokenriver: a readable LLM inference engine that shows how generation happens."""

from tokenriver.config import EngineConfig
from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.engine.llm import LLM
from tokenriver.outputs import CompletionOutput, FinishReason, RequestOutput
from tokenriver.params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "FinishReason",
           "EngineConfig", "__version__"]
