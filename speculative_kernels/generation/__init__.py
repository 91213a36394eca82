"""Speculative decoding with HF models: ``generate`` (front end) -> ``request.build_loop`` (a call, checked, as a
ready loop) -> ``loop.SpeculativeLoop`` (draft, verify, emit, roll back) over a ``drafter.Drafter`` and the
``runners`` that drive each model's KV cache. Layers: ``docs/architecture.md``."""

from .generate import generate
from .options import BatchingOptions, CompileOptions
from .outputs import SpeculativeDecoderOnlyOutput, SpeculativeEncoderDecoderOutput
from .stats import SpeculationStats

__all__ = ["generate", "BatchingOptions", "CompileOptions", "SpeculationStats", "SpeculativeDecoderOnlyOutput",
           "SpeculativeEncoderDecoderOutput"]
