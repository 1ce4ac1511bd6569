"""tokenriver: a readable LLM inference engine that shows how generation happens."""

import gc

# Importing torch and the engine creates a few hundred thousand objects that live as long as the process
# (modules, classes, functions). CPython's cycle collector traverses them again and again while they are being
# created: 0.2-0.37 s of start-up measured with gc.callbacks, freeing nothing. So collection pauses for these
# imports, and freeze() + unfreeze() then moves every object straight to the oldest generation (not exempt
# from collection, just not traversed by the young generations' passes): 0.01 s of collection from the import
# to the first generated token.
_collecting = gc.isenabled()
gc.disable()
try:
    from tokenriver.config import EngineConfig
    from tokenriver.engine.async_engine import AsyncEngine
    from tokenriver.engine.llm import LLM
    from tokenriver.outputs import CompletionOutput, FinishReason, RequestOutput
    from tokenriver.params import SamplingParams, StructuredOutput
finally:
    gc.freeze()
    gc.unfreeze()
    if _collecting:
        gc.enable()

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "StructuredOutput", "RequestOutput", "CompletionOutput", "FinishReason",
           "EngineConfig", "__version__"]
