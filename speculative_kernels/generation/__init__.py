"""The generate loop: settings, model runners, the speculative loop and the HF-compatible front end."""

from .generate import SpeculativeDecoderOnlyOutput, generate
from .stats import SpeculationStats

__all__ = ["generate", "SpeculationStats", "SpeculativeDecoderOnlyOutput"]
