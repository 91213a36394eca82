"""speculative-kernels: exact speculative decoding (Leviathan et al. 2023) for Hugging Face models."""

from . import ops
from .decoder import DecodeSession, SpeculativeDecoder
from .generation import SpeculationStats, SpeculativeDecoderOnlyOutput, SpeculativeEncoderDecoderOutput, generate

__version__ = "0.1.0"
__all__ = ["generate", "ops", "SpeculativeDecoder", "DecodeSession", "SpeculationStats", "SpeculativeDecoderOnlyOutput",
           "SpeculativeEncoderDecoderOutput", "__version__"]
