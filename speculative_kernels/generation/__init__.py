"""Speculative decoding with HF models: ``generate`` (front end) -> ``request.build_loop`` (a call, checked, as a
ready loop) -> ``loop.SpeculativeLoop`` (draft, verify, emit, roll back) over a ``drafter.Drafter`` and the
``runners`` that drive each model's KV cache. Layers: ``docs/architecture.md``."""

from .drafter import Drafter, emitted_counts
from .generate import generate
from .hooks import per_token_hook
from .lookup_drafter import PromptLookupDrafter
from .ngram_drafter import NGramDrafter
from .options import BatchingOptions, CompileOptions
from .outputs import SpeculativeDecoderOnlyOutput, SpeculativeEncoderDecoderOutput
from .stats import SpeculationStats

__all__ = ["generate", "per_token_hook", "BatchingOptions", "CompileOptions", "Drafter", "emitted_counts", "NGramDrafter",
           "PromptLookupDrafter", "SpeculationStats", "SpeculativeDecoderOnlyOutput", "SpeculativeEncoderDecoderOutput"]
