"""The generate loop: settings, model runners, the speculative loop and the HF-compatible front end."""

from .generate import SpeculativeDecoderOnlyOutput, generate
from .seq2seq import SpeculativeEncoderDecoderOutput
from .stats import SpeculationStats

__all__ = ["generate", "SpeculationStats", "SpeculativeDecoderOnlyOutput", "SpeculativeEncoderDecoderOutput"]
