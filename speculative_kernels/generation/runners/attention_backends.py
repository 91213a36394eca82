"""Which SDPA backends a runner's eager forward may use: every backend the caller has enabled except cuDNN attention,
on CUDA, for the forwards that pass an explicit attention mask (all of a runner's forwards).

torch 2.11 (its bundled cuDNN > 9.15.0) puts cuDNN attention first in SDPA's order on sm90 / sm100
(``check_prefer_cudnn_attention`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp). Flash attention takes no
mask, so a masked call goes to cuDNN, which builds an execution plan for every new combination of q/k/v/mask shapes
and strides (``MHACacheKeyWrapper`` in aten/src/ATen/native/cudnn/MHA.cpp) before it runs. The runners' key length
is their slot count: on the dynamic cache it changes at every forward (each draft step, each verification, each
rollback, join or leave), so nearly every forward of a serving batch (or of a first ``generate`` over a new prompt)
meets a shape cuDNN has not planned for yet. Such a plan was reported at ~0.4 s (modelscope/FunASR#3704 on a B200
with torch 2.11, sgl-project/sglang#4650), far more than a forward; our H200 serving run's dynamic-cache steps fit
~50 ms per new shape (benchmarks/RESULTS.md, fourth GPU run; ``benchmarks/diagnose_serving_gpu.py`` measures it).
Mem-efficient attention takes the same additive mask with no per-shape planning.

A caller who enabled cuDNN and no other backend that takes a mask (mem-efficient, math) keeps it
(``with sdpa_kernel(SDPBackend.CUDNN_ATTENTION): generate(...)``: flash takes no mask); on other
devices, with cuDNN attention off, or for models whose attention is not SDPA, nothing changes. The captured steps of
``compile=True`` are left as torch's default (not wrapped, or the switch does nothing while compiling): their shapes
are fixed, so cuDNN plans once. torch's backend switches are process state: another thread's SDPA calls during one
of our forwards see the same restriction, and another thread's own ``sdpa_kernel`` entered and left across one of
our forwards can restore the flags in the other order (both contexts restore what they found).
"""

import contextlib

import torch

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # (torch without torch.nn.attention: its SDPA has no cuDNN backend either)
    SDPBackend = sdpa_kernel = None


def without_cudnn_attention(device: torch.device):
    """A context for one forward on ``device``: SDPA without its cuDNN backend (see the module docstring)."""
    if (sdpa_kernel is None or device.type != "cuda" or torch.compiler.is_compiling()
            or not torch.backends.cuda.cudnn_sdp_enabled()):  # (a captured step keeps torch's default)
        return contextlib.nullcontext()
    cuda = torch.backends.cuda
    masked = [backend for backend, on in ((SDPBackend.EFFICIENT_ATTENTION, cuda.mem_efficient_sdp_enabled()),
                                          (SDPBackend.MATH, cuda.math_sdp_enabled())) if on]
    if not masked:  # (flash takes no mask: without a backend that does, cuDNN stays, as the caller set it)
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, *masked] if cuda.flash_sdp_enabled() else masked)
