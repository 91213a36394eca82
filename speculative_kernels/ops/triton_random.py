"""Device functions shared by the Triton kernels: Philox4x32-10 and float helpers that round like the reference.

Philox follows ``philox.py`` word for word (same multipliers, key schedule and counter layout), written with
``tl.umulhi`` on uint32 so the kernels draw exactly the reference's bits without materialising a noise tensor.

``PRECISE`` (a constexpr, set on GPUs) routes exp/log/mul/add through libdevice's correctly rounded or non-fusable
versions: Triton's ``tl.exp``/``tl.log`` lower to the approximate ``ex2``/``lg2`` instructions and its default fp
fusion would contract ``a * b + c`` into an FMA, while the torch reference rounds every operation on its own. In
the interpreter (CPU), numpy already rounds every float32 operation separately, and libdevice is not available.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .philox import (
    EXP_SERIES_CUTOFF,
    PHILOX_M0,
    PHILOX_M1,
    PHILOX_ROUNDS,
    PHILOX_W0,
    PHILOX_W1,
    U24_SCALE,
    U32_SCALE,
    U_MAX,
    U_MIN,
)

_M0 = tl.constexpr(PHILOX_M0)
_M1 = tl.constexpr(PHILOX_M1)
_W0 = tl.constexpr(PHILOX_W0)
_W1 = tl.constexpr(PHILOX_W1)
_ROUNDS = tl.constexpr(PHILOX_ROUNDS)
_U24 = tl.constexpr(U24_SCALE)
_U32 = tl.constexpr(U32_SCALE)
_UMIN = tl.constexpr(U_MIN)
_UMAX = tl.constexpr(U_MAX)
_CUTOFF = tl.constexpr(EXP_SERIES_CUTOFF)
_THIRD = tl.constexpr(1.0 / 3.0)


@triton.jit
def philox_key(seed):
    """int64 seed (scalar) -> (k0, k1) uint32 key words: low and high 32 bits."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return k0, k1


@triton.jit
def philox_words(k0, k1, c0, c1, c2, c3):
    """The four output words of Philox4x32-10. All arguments uint32 (scalars or blocks, broadcast; c0 a block
    makes every word one); returns four uint32."""
    for _ in tl.static_range(_ROUNDS):
        hi0 = tl.umulhi(c0, _M0)
        lo0 = tl.mul(c0, _M0, sanitize_overflow=False)  # wrapping uint32 arithmetic is intended
        hi1 = tl.umulhi(c2, _M1)
        lo1 = tl.mul(c2, _M1, sanitize_overflow=False)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = tl.add(k0, _W0, sanitize_overflow=False)
        k1 = tl.add(k1, _W1, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def philox_first_word(k0, k1, c0, c1, c2, c3):
    """First output word of Philox4x32-10. All arguments uint32 (scalars or blocks, broadcast); returns uint32."""
    word, _, _, _ = philox_words(k0, k1, c0, c1, c2, c3)
    return word


@triton.jit
def vocabulary_bits(k0, k1, base, c1, c2, c3, BLOCK: tl.constexpr):
    """uint32 [BLOCK] words of the ids base + arange(BLOCK), base a multiple of 4: id v takes word v % 4 of the
    call at counter (v // 4, c1, c2, c3) (``philox.vocabulary_bits``), so BLOCK / 4 calls for BLOCK ids."""
    groups = (base // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    w0, w1, w2, w3 = philox_words(k0, k1, groups, c1, c2, c3)
    # interleave(w0, w2) = w0[0], w2[0], w0[1], ...; interleaving that with (w1, w3)'s gives w0[g], w1[g], w2[g], w3[g]
    return tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))


@triton.jit
def uniform_from_bits(x):
    """uint32 -> float32 uniform in [0, 1): float32(x >> 8) * 2**-24 (exact)."""
    return (x >> 8).to(tl.float32) * _U24


@triton.jit
def precise_exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def precise_log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def exponential_from_bits(x, PRECISE: tl.constexpr):
    """uint32 -> float32 Exp(1) draw, the reference's arithmetic: u = min(max(float32(x) * 2**-32, 2**-33),
    1 - 2**-24), then u * (1 + u * (1/2 + u / 3)) for u < 2**-8 (full relative precision for the draws that win
    races), else -log(1 - u): finite, never 0. Every product and sum is rounded on its own (libdevice *_rn: never contracted into an FMA)."""
    u = tl.minimum(tl.maximum(x.to(tl.float32) * _U32, _UMIN), _UMAX)
    if PRECISE:
        series = libdevice.mul_rn(u, libdevice.add_rn(libdevice.mul_rn(u, libdevice.add_rn(
            libdevice.mul_rn(u, _THIRD), 0.5)), 1.0))
        tail = -libdevice.log(1.0 - u)
    else:
        series = u * (1.0 + u * (0.5 + u * _THIRD))
        tail = -tl.log(1.0 - u)
    return tl.where(u < _CUTOFF, series, tail)
