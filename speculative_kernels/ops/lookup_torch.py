"""The plain-PyTorch backend of ``prompt_lookup``: the reference itself (any device, traceable by torch.compile)."""

from .lookup import prompt_lookup_reference as prompt_lookup

__all__ = ["prompt_lookup"]
