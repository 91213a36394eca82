"""Philox4x32-10 in torch (``ops/philox.py``): Random123's known answers, and the fast path (int64 products that
wrap, the two words of a round stacked) bit-identical to the split path (16-bit partial products, no overflow) that
defines it."""

import pytest
import torch

from speculative_kernels.ops import philox

# Random123 kat_vectors, philox4x32 10: (counter c0..c3, key k0 k1) -> first output word.
KAT = [
    ((0, 0, 0, 0), (0, 0), 0x6627E8D5),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), 0x408F276D),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), 0xD16CFE09),
]


def _seed(k0: int, k1: int) -> int:
    seed = k0 | (k1 << 32)
    return seed - 2**64 if seed >= 2**63 else seed  # as the int64 a caller holds


@pytest.mark.parametrize("counter,key,want", KAT)
def test_known_answers(counter, key, want):
    got = philox.philox_first_word(torch.tensor(_seed(*key)), *(torch.tensor(c) for c in counter))
    assert int(got) == want


def test_cpu_int64_products_wrap():
    assert philox.INT64_PRODUCTS_WRAP["cpu"]  # else every CPU call takes the slower split path


@pytest.mark.parametrize("batch,vocab", [(1, 1), (1, 4099), (5, 777)])
def test_stacked_rounds_equal_the_split_rounds(batch, vocab):
    g = torch.Generator().manual_seed(batch * vocab)
    seed = torch.randint(-2**63, 2**63 - 1, (batch, 1), generator=g)
    counters = [torch.arange(vocab).unsqueeze(0), torch.arange(batch).unsqueeze(1),
                torch.randint(0, 2**32, (batch, 1), generator=g), torch.full((batch, 1), 0x40000000)]
    k0, k1 = seed & philox.MASK32, (seed >> 32) & philox.MASK32
    counters = [c & philox.MASK32 for c in counters]
    split = philox._rounds_split(k0, k1, *torch.broadcast_tensors(*counters))
    stacked = philox._rounds_stacked(k0, k1, *counters)  # words broadcast within the rounds
    assert torch.equal(split, stacked)
    assert torch.equal(philox.philox_first_word(seed, *counters), split)
    all_split = philox._rounds_split(k0, k1, *torch.broadcast_tensors(*counters), all_words=True)
    assert torch.equal(philox._rounds_stacked(k0, k1, *counters, all_words=True), all_split)  # [B, V, 4]
    assert torch.equal(all_split[..., 0], split)


@pytest.mark.parametrize("seed_shape,counter_shapes", [
    ((), [(7,), (), (), ()]),  # a 0-d key against a row of counters
    ((3, 1), [(5,), (3, 1), (), (1, 1)]),  # a key with more dimensions than a counter
    ((2,), [(4, 1), (), (2,), ()]),  # a key broadcast on the last dimension
])
def test_stacked_rounds_broadcast_keys_and_counters_of_any_shapes(seed_shape, counter_shapes):
    g = torch.Generator().manual_seed(len(counter_shapes[0]))
    seed = torch.randint(-2**63, 2**63 - 1, seed_shape, generator=g)
    counters = [torch.randint(0, 2**32, shape, generator=g) for shape in counter_shapes]
    k0, k1 = seed & philox.MASK32, (seed >> 32) & philox.MASK32
    split = philox._rounds_split(k0, k1, *torch.broadcast_tensors(*counters))
    stacked = philox._rounds_stacked(k0, k1, *counters)
    assert stacked.shape == torch.broadcast_shapes(seed_shape, *counter_shapes)
    assert torch.equal(stacked, split.expand(stacked.shape))


@pytest.mark.parametrize("default", [torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_uniforms_and_exponentials_are_float32_whatever_torchs_default_dtype(default):
    """An int64 tensor times a Python float takes torch's default dtype: with the bits' float32 conversion folded
    into the scaling (944e4ca), a default of bfloat16 (set before building a bf16 model, a common pattern) made
    uniforms of 1.0 and exponentials of inf / NaN, and float64 other exponentials than the kernels'. The accept test
    and the races read the same float32 numbers as with float32 as the default."""
    bits = torch.tensor([0, 1, 255, 256, 0x00FFFFFF, 12345679, 0x7FFFFFFF, 0x80000001, 0xFFFFFF7F, 0xFFFFFFFF])
    want = philox.uniform_from_bits(bits), philox.exponential_from_bits(bits)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = philox.uniform_from_bits(bits), philox.exponential_from_bits(bits)
    finally:
        torch.set_default_dtype(saved)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and torch.equal(a, b), (a, b)
