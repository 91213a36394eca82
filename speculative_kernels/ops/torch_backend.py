"""The plain-PyTorch backend: the reference implementation itself (any device, traceable by torch.compile)."""

from .reference import sample_reference as sample
from .reference import verify_reference as verify

__all__ = ["sample", "verify"]
