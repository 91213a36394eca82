"""Counter-based random numbers shared bit-for-bit by every backend (torch, Triton, CUDA).

Philox4x32-10 (Salmon et al., SC'11) keyed by a 64-bit seed: key = (seed & 0xffffffff, seed >> 32), counter
(c0, c1, c2, c3), four 32-bit output words per call. The project fixes the counter layout:

    c0 = element index: for a vocabulary-indexed stream (the races: STREAM_POSITION + j, STREAM_DRAFT) id v takes
         word v % 4 of the call at c0 = v // 4 (``vocabulary_bits``: one call per four ids); the accept test's
         uniform for draft position i is the first word of the call at c0 = i, and each row-key word the first word
         of its call
    c1 = row id (the batch row b; 0 when the caller gives a seed per row, so a row's numbers do not
         depend on which batch it sits in)
    c2 = offset (the caller's step counter, < 2**32)
    c3 = stream: STREAM_ACCEPT for the accept test's uniforms, STREAM_POSITION + j for sampling at block
         position j in verify, STREAM_DRAFT for the draft-side sampler, STREAM_ROW_KEY + {0, 1} for the per-row
         keys (``randomness.row_keys``). The stream ids are defined here only: the Triton kernels import them, and
         ``csrc/philox_streams.h`` is generated from ``STREAMS`` by ``streams_header()`` (a test checks that the
         file is current).

From a 32-bit word x:
    uniform(x)     = float32(x >> 8) * 2**-24                      in [0, 1), exact in float32
    exponential(x) = -log1p(-u), u = min(max(float32(x) * 2**-32, 2**-33), 1 - 2**-24), with log1p(-u) taken
                     as -(u + u^2/2 + u^3/3) for u < 2**-8 (so small draws, which decide the race, keep full
                     relative precision on every backend) and log(1 - u) otherwise: in (0, 24 ln 2], never 0 and
                     never +inf. (float32(x) rounds to 2**32 for the 128 largest x: an E of +inf there made the key
                     w / E of a positive weight 0, tied with the weight-0 ids' keys, so an id of weight 0 could win.)

The torch implementation below is the reference; the kernels implement the same arithmetic.

Until 2026-11-27 a race's id v took the first word of the call at c0 = v (three of each call's four words thrown
away): a given seed now draws other tokens than it did before that change, from the same distribution.
"""

import torch

PHILOX_ROUNDS = 10
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
MASK32 = 0xFFFFFFFF
WORDS_PER_CALL = 4  # a vocabulary-indexed stream takes all four words of a call (``vocabulary_bits``)

STREAM_ACCEPT = 0
STREAM_POSITION = 1  # + block position j (0..K)
STREAM_DRAFT = 0x40000000
STREAM_ROW_KEY = 0x60000000  # + 0, + 1
# The C++ name and meaning of every stream id, for csrc/philox_streams.h.
STREAMS = {
    "kStreamAccept": (STREAM_ACCEPT, "accept-test uniforms, c0 = draft position i"),
    "kStreamPosition": (STREAM_POSITION, "+ block position j: the race at position j of verify"),
    "kStreamDraft": (STREAM_DRAFT, "the draft-side sampler"),
    "kStreamRowKey": (STREAM_ROW_KEY, "+ 0, + 1: the two words of a row's key (randomness.row_keys)"),
}

EXP_SERIES_CUTOFF = 2.0**-8
U32_SCALE = 2.0**-32
U24_SCALE = 2.0**-24
U_MIN = 2.0**-33
U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b, for a in [0, 2**32) held in int64, from 16-bit partial
    products that never overflow."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    t = a * b_lo  # < 2**48
    u = a * b_hi + (t >> 16)  # < 2**49
    hi = u >> 16
    lo = ((u & 0xFFFF) << 16) | (t & 0xFFFF)
    return hi & MASK32, lo & MASK32


def _rounds_split(k0, k1, c0, c1, c2, c3, all_words: bool = False) -> torch.Tensor:
    """The ten rounds with ``_mulhilo``: the definition, and the path wherever int64 products may not wrap.
    Returns the first output word, or with ``all_words`` the four words stacked on a new last dimension [..., 4]."""
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1) if all_words else c0


# What a multiplicand becomes in one round: (the word its product's high half makes, the word xored into that half,
# the key word xored in (0: k0, 1: k1), its multiplier, the word its product's low half makes).
_ROLES = {"c0": ("c2", "c3", 1, PHILOX_M0, "c3"), "c2": ("c0", "c1", 0, PHILOX_M1, "c1")}


def _stacked_schedule() -> tuple[tuple[tuple[int, bool, int], ...], tuple[str, str], tuple[str, str]]:
    """The rounds of ``_rounds_stacked`` on a [2, ...] pair of multiplicands (c0, c2 in some order) and a [2, ...]
    pair of the words xored into their products' high halves (the previous products, whose low halves are c1, c3).
    Per round: (slot 0's multiplier, whether the high halves cross slots, slot 0's key word); and after the last
    round, the output word each slot of the multiplicands holds (c0, c2) and each slot of the last products' low
    halves (c1, c3). Worked out once from ``_ROLES`` (a constant, not a cache)."""
    xs, ys, rounds = ("c0", "c2"), ("c3", "c1"), []
    for _ in range(PHILOX_ROUNDS):
        source = [next(i for i in (0, 1) if _ROLES[xs[i]][1] == ys[j]) for j in (0, 1)]
        rounds.append((_ROLES[xs[0]][3], source[0] == 1, _ROLES[xs[source[0]]][2]))
        xs, ys = tuple(_ROLES[xs[i]][0] for i in source), tuple(_ROLES[x][4] for x in xs)
    return tuple(rounds), xs, ys


STACKED_ROUNDS, _FINAL_MULTIPLICANDS, _FINAL_PRODUCTS = _stacked_schedule()
STACKED_FINAL_SLOT = _FINAL_MULTIPLICANDS.index("c0")
# Output word w (0..3) of the stacked rounds: (whether it is a multiplicand (else a product's low half), its slot).
STACKED_FINAL_WORDS = tuple(
    (True, _FINAL_MULTIPLICANDS.index(w)) if w in _FINAL_MULTIPLICANDS else (False, _FINAL_PRODUCTS.index(w))
    for w in ("c0", "c1", "c2", "c3"))


def _signed32(word: int) -> int:
    """A 32-bit constant as the int32 of the same bits (W - 2**32 for W >= 2**31): k + r * W and k + r * (W - 2**32)
    agree modulo 2**32, so the masked round keys are the same. Inductor turns ``arange * W`` into an index expression
    it writes into Triton as an int32 literal: 0x9E3779B9 there failed to compile ("Scalar 2654435769 is out of range
    for type int32", torch 2.11 on an H200, ``backend="torch"`` under ``torch.compile``); the int32 value compiles, and
    a product that wraps in int32 still has the right low 32 bits."""
    return word - (1 << 32) if word >= 1 << 31 else word


def _rounds_stacked(k0, k1, c0, c1, c2, c3, all_words: bool = False) -> torch.Tensor:
    """The same rounds where an int64 product wraps modulo 2**64 (two's complement, as CPUs and CUDA multiply):
    the product p of two 32-bit words is then exact in its 64 bits, hi = (p >> 32) & mask, lo = p & mask.

    The round's two multiplications run as one on a [2, *shape] tensor (c0 and c2 stacked, times a [2, 1, ...]
    multiplier), and so do its shift, xors and mask; the round keys of all ten rounds come from one arange. A
    product is kept whole (its low half is the next round's c1 or c3, its high half is masked off by the next round's
    mask), so a round is 5 ops (6 when the high halves cross slots) on three buffers that rotate: no allocation
    in the rounds; the last one makes c0 alone (one slot's product). Arguments broadcast; int64 in [0, 2**32).
    With ``all_words`` the last round is a full one and the four output words come back as [*shape, 4]."""
    shape = torch.broadcast_shapes(k0.shape, k1.shape, c0.shape, c1.shape, c2.shape, c3.shape)
    dims = len(shape)
    x = torch.stack([c0.expand(shape), c2.expand(shape)])  # [2, *shape]: the multiplicands
    y = torch.stack([c3.expand(shape), c1.expand(shape)])  # [2, *shape]: the words xored into their products' hi
    buffers = [x, y, torch.empty_like(x)]
    halves = [buffer.unbind(0) for buffer in buffers]
    steps = torch.arange(0, PHILOX_ROUNDS, device=x.device).view((PHILOX_ROUNDS,) + (1,) * dims)
    k0 = (k0 + steps * _signed32(PHILOX_W0)) & MASK32  # [R, ...]: the round keys (steps' dims right-align them)
    k1 = (k1 + steps * _signed32(PHILOX_W1)) & MASK32
    keys = torch.stack([k0, k1, k0], dim=1)  # [R, 3, ...]: rows 0:2 are (k0, k1), rows 1:3 (k1, k0)
    keys = (keys[:, 0:2].unbind(0), keys[:, 1:3].unbind(0))  # views: keys[slot 0's key word][round]
    multipliers = x.new_full((3,) + (1,) * dims, PHILOX_M0)  # (M0, M1, M0): [0:2] and [1:3] are both orders
    multipliers[1].fill_(PHILOX_M1)
    multipliers = {PHILOX_M0: multipliers[0:2], PHILOX_M1: multipliers[1:3]}
    xi, yi, free = 0, 1, 2
    for r, (multiplier, cross, key) in enumerate(STACKED_ROUNDS if all_words else STACKED_ROUNDS[:-1]):
        x = buffers[xi]
        p = torch.mul(x, multipliers[multiplier], out=buffers[free])
        if cross:  # the high halves change slots
            torch.bitwise_right_shift(halves[free][1], 32, out=halves[xi][0])
            torch.bitwise_right_shift(halves[free][0], 32, out=halves[xi][1])
        else:
            torch.bitwise_right_shift(p, 32, out=x)
        x ^= buffers[yi]
        x ^= keys[key][r]
        if r < PHILOX_ROUNDS - 1:  # (the four words of the last round are masked together below)
            x &= MASK32
        free, yi = yi, free
    if all_words:  # buffers[xi]: the multiplicands (c0, c2); buffers[yi]: the last products (low halves: c1, c3)
        words = torch.stack([halves[xi if multiplicand else yi][slot] for multiplicand, slot in STACKED_FINAL_WORDS],
                            dim=-1)
        return words.bitwise_and_(MASK32)
    # The last round makes c0 only: one slot's product.
    multiplier, cross, key = STACKED_ROUNDS[-1]
    slot = STACKED_FINAL_SLOT
    source = 1 - slot if cross else slot
    c0 = halves[xi][source] * (multiplier if source == 0 else PHILOX_M0 + PHILOX_M1 - multiplier)
    c0 >>= 32
    c0 ^= halves[yi][slot]
    c0 ^= keys[key][PHILOX_ROUNDS - 1][slot]
    return c0.bitwise_and_(MASK32)


def _int64_products_wrap(device_type: str) -> bool:
    """Whether int64 products on this device type keep the low 64 bits past 2**63: checked on the CPU (vectorised
    and scalar kernels) against Python's integers; CUDA's 64-bit multiply (mul.lo.s64) does by definition; any
    other device takes the split path."""
    if device_type == "cuda":
        return True
    if device_type != "cpu":
        return False
    words = [0xFFFFFFFF, 0xFFFFFFFE, 0x80000001, 0xD2511F53, 0x12345678, 1, 0]
    for values in (words * 5, words[:1]):
        a = torch.tensor(values, dtype=torch.int64, device="cpu")  # (not the default device)
        for m in (PHILOX_M0, PHILOX_M1):
            want = [(v * m + 2**63) % 2**64 - 2**63 for v in values]
            by_tensor = a.expand(2, -1) * torch.tensor([[m], [m]], dtype=torch.int64, device="cpu")  # as _rounds_stacked
            if (a * m).tolist() != want or by_tensor.tolist() != [want, want]:
                return False
    return True


INT64_PRODUCTS_WRAP = {"cpu": _int64_products_wrap("cpu"), "cuda": True}


def _philox(seed, c0, c1, c2, c3, all_words: bool) -> torch.Tensor:
    seed = seed.to(torch.int64)
    k0 = seed & MASK32
    k1 = (seed >> 32) & MASK32
    c0, c1, c2, c3 = (c.to(device=seed.device, dtype=torch.int64) & MASK32 for c in (c0, c1, c2, c3))
    wraps = INT64_PRODUCTS_WRAP.get(seed.device.type, False)
    return (_rounds_stacked if wraps else _rounds_split)(k0, k1, c0, c1, c2, c3, all_words=all_words)


def philox_first_word(
    seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor
) -> torch.Tensor:
    """First output word of Philox4x32-10, as int64 in [0, 2**32). All arguments broadcast (int64 tensors; the
    counters are moved to ``seed``'s device, so a 0-d CPU constant may stand for one)."""
    return _philox(seed, c0, c1, c2, c3, all_words=False)


def philox_words(
    seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor
) -> torch.Tensor:
    """The four output words of Philox4x32-10, as int64 in [0, 2**32): [*broadcast shape, 4] (arguments as
    ``philox_first_word``'s)."""
    return _philox(seed, c0, c1, c2, c3, all_words=True)


def vocabulary_bits(seed: torch.Tensor, vocab: int, c1: torch.Tensor, c2: torch.Tensor,
                    c3: torch.Tensor) -> torch.Tensor:
    """The word of every vocabulary id v in [0, vocab): word v % 4 of the call at counter (v // 4, c1, c2, c3), one
    Philox call per ``WORDS_PER_CALL`` ids. seed, c1, c2, c3 broadcast to [..., 1] (e.g. [B, 1]). Returns
    [..., vocab] int64 in [0, 2**32)."""
    groups = (vocab + WORDS_PER_CALL - 1) // WORDS_PER_CALL
    c0 = torch.arange(groups, dtype=torch.int64, device=seed.device)
    return philox_words(seed, c0, c1, c2, c3).flatten(-2)[..., :vocab]  # [..., groups, 4] -> [..., vocab]


def uniform_from_bits(x: torch.Tensor) -> torch.Tensor:
    """uniform(x) in [0, 1): float32((x >> 8)) * 2**-24."""
    # (float32 named: an int64 tensor times a Python float takes torch's default dtype, which a caller may have set)
    return (x >> 8).to(torch.float32).mul_(U24_SCALE)


def exponential_from_bits(x: torch.Tensor) -> torch.Tensor:
    """exponential(x) >= 0 (float32), see the module docstring for the exact arithmetic."""
    u = torch.clamp(x.to(torch.float32).mul_(U32_SCALE), min=U_MIN, max=U_MAX)  # (float32 named: see uniform_from_bits)
    series = u * (1.0 + u * (0.5 + u * (1.0 / 3.0)))
    return torch.where(u < EXP_SERIES_CUTOFF, series, -torch.log(1.0 - u))


def streams_header() -> str:
    """The text of ``csrc/philox_streams.h``: ``STREAMS`` as C++ constants (host- and device-usable)."""
    lines = [
        "// Philox stream ids (counter word c3), generated from speculative_kernels/ops/philox.py, which defines them:",
        "// (a comment line never ends in a backslash here: nvcc's -Wcomment would warn of a multi-line comment)",
        "//   python -c 'from speculative_kernels.ops.philox import streams_header as h; print(h(), end=\"\")' >",
        "//       csrc/philox_streams.h",
        "// Do not edit by hand (tests/ops/test_random_streams.py checks that this file is current).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace speculative_kernels {",
        "",
        *(f"constexpr uint32_t {name} = 0x{value:08X}u;  // {meaning}" for name, (value, meaning) in STREAMS.items()),
        "",
        "}  // namespace speculative_kernels",
    ]
    return "\n".join(lines) + "\n"
