"""speculative-kernels: exact speculative decoding (Leviathan et al. 2023) for Hugging Face models."""

from . import ops

__version__ = "0.1.0"
__all__ = ["ops", "__version__"]
