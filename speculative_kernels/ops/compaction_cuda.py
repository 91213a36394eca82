"""CUDA backend of ``compact_kv`` (semantics: ``compaction.py``): ``torch.ops.speculative_kernels_cuda.compact_kv_``
from ``csrc/rollback_kernels.cu`` (bound in ``csrc/rollback_bindings.cpp``, built with the rest of the extension).

Importing this module loads the extension (``cuda_ext.load()``, raising with the reason where it cannot); the fake
registered here lets ``torch.compile`` trace the in-place op.
"""

import torch

from . import cuda_ext
from .cuda_host import compact_kv_with

cuda_ext.load()

__all__ = ["compact_kv"]


@torch.library.register_fake("speculative_kernels_cuda::compact_kv_")
def _compact_kv_fake(kv, slot_mask):
    return None


def compact_kv(tensors, slot_mask) -> None:
    """tensors: list of [B, H, S, D] CUDA tensors (unit stride over D); slot_mask: [B, S]. In place (the host side:
    ``cuda_host.compact_kv_with``)."""
    compact_kv_with(torch.ops.speculative_kernels_cuda.compact_kv_, tensors, slot_mask)
