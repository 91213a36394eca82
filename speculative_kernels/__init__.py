"""speculative-kernels: exact speculative decoding (Leviathan et al. 2023) for Hugging Face models.

The public names are imported on first use (PEP 562), so that ``import speculative_kernels`` (and the console
command's ``--help``) does not pay for importing torch and transformers until something needs them.
"""

import importlib
import threading

__version__ = "0.1.0"
_EXPORTS = {
    "generate": ".generation",
    "per_token_hook": ".generation",
    "SpeculationStats": ".generation",
    "SpeculativeDecoderOnlyOutput": ".generation",
    "SpeculativeEncoderDecoderOutput": ".generation",
    "BatchingOptions": ".generation",
    "CompileOptions": ".generation",
    "Drafter": ".generation",
    "emitted_counts": ".generation",
    "NGramDrafter": ".generation",
    "PromptLookupDrafter": ".generation",
    "SpeculativeDecoder": ".decoder",
    "DecodeSession": ".decoder",
    "IncrementalDetokenizer": ".streaming",
}
__all__ = ["generate", "per_token_hook", "ops", "SpeculativeDecoder", "DecodeSession", "IncrementalDetokenizer", "SpeculationStats",
           "SpeculativeDecoderOnlyOutput", "SpeculativeEncoderDecoderOutput", "BatchingOptions", "CompileOptions",
           "Drafter", "emitted_counts", "NGramDrafter", "PromptLookupDrafter", "__version__"]


# First uses from several threads at once import the submodules one at a time: their circular imports, entered from
# other modules in another thread, could be handed a partially initialised module (an ImportError seen once in ~30
# runs of three threads whose first calls were generate, SpeculativeDecoder and ops.verify).
_IMPORT_LOCK = threading.RLock()


def __getattr__(name: str):
    if name != "ops" and name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _IMPORT_LOCK:
        if name == "ops":
            value = importlib.import_module(".ops", __name__)
        else:
            value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
