"""The vocabulary-indexed random streams' layout (``ops/philox.py``): id v takes word v % 4 of the Philox4x32-10 call at
counter (v // 4, row, offset, stream), pinned against the definition (``philox._rounds_split``, the 16-bit partial
products) and Random123's known answers for all four words.

``check_races_draw_the_layout`` pins what a backend's races draw: p uniform over 8 ids (logits 0 there, -inf
elsewhere; p = 1/8 exactly on every backend, so p / E orders exactly as 1 / E) makes the race's winner the id of the
smallest exponential, i.e. of the smallest word, among ids in different places of their groups of four: the first
group, one in the middle, the last three ids (V = 4k + 1, 4k + 2, 4k + 3 put them in one or two groups). Rows with
their own seeds and offsets, rows that are not 16-byte aligned (the CUDA scalar path), the draft sampler's stream and
verify's race after a rejection (STREAM_POSITION + 0). The CUDA kernels run it in ``test_cuda_emulated.py``, Triton
in ``test_triton_ops.py``.
"""

import pytest
import torch

from speculative_kernels.ops import philox
from speculative_kernels.ops.randomness import Randomness
from speculative_kernels.ops.reference import race_noise, sample_reference, verify_reference
from speculative_kernels.ops.sampling import Sampling

# Random123 kat_vectors, philox4x32 10: (counter c0..c3, key k0 k1) -> the four output words.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _seed(k0: int, k1: int) -> int:
    seed = k0 | (k1 << 32)
    return seed - 2**64 if seed >= 2**63 else seed  # as the int64 a caller holds


@pytest.mark.parametrize("counter,key,want", KAT)
def test_four_words_known_answers(counter, key, want):
    counters = [torch.tensor(c) for c in counter]
    assert philox.philox_words(torch.tensor(_seed(*key)), *counters).tolist() == list(want)  # the stacked path
    k0, k1 = (torch.tensor(k) for k in key)
    assert philox._rounds_split(k0, k1, *counters, all_words=True).tolist() == list(want)


def defined_words(seed: torch.Tensor, v: torch.Tensor, c1, c2, c3) -> torch.Tensor:
    """Id v's word by the definition: word v % 4 of the split rounds at counter (v // 4, c1, c2, c3). seed: int64;
    all arguments broadcast (tensors or ints)."""
    k0, k1 = seed & philox.MASK32, (seed >> 32) & philox.MASK32
    c1, c2, c3 = (torch.as_tensor(c) for c in (c1, c2, c3))
    words = philox._rounds_split(k0, k1, v // 4, c1, c2, c3, all_words=True)  # [..., 4]
    return words.gather(-1, (v % 4).expand(words.shape[:-1]).unsqueeze(-1)).squeeze(-1)


def defined_word(seed: int, v: int, c1: int, c2: int, c3: int) -> int:
    return int(defined_words(torch.tensor(seed), torch.tensor(v), c1, c2, c3))


@pytest.mark.parametrize("vocab", [1, 2, 3, 4097, 4098, 4099, 4100])
def test_vocabulary_bits_take_word_v_mod_4_of_the_call_at_v_div_4(vocab):
    g = torch.Generator().manual_seed(vocab)
    seed = torch.randint(-2**63, 2**63 - 1, (3, 1), generator=g)
    c1 = torch.tensor([[0], [1], [2]])
    c2 = torch.randint(0, 2**32, (3, 1), generator=g)
    c3 = torch.tensor([[philox.STREAM_DRAFT], [philox.STREAM_POSITION], [philox.STREAM_POSITION + 3]])
    bits = philox.vocabulary_bits(seed, vocab, c1, c2, c3)
    assert bits.shape == (3, vocab)
    ids = sorted({0, 1, 2, 3, vocab // 2, vocab - 3, vocab - 2, vocab - 1} & set(range(vocab)))
    for b in range(3):
        for v in ids:
            assert int(bits[b, v]) == defined_word(int(seed[b]), v, int(c1[b]), int(c2[b]), int(c3[b])), (b, v)
    # every id: word v % 4 of the calls at v // 4, the first word of which is philox_first_word's
    groups = torch.arange((vocab + 3) // 4)
    words = philox.philox_words(seed, groups, c1, c2, c3)  # [3, groups, 4]
    want = torch.stack([words[:, v // 4, v % 4] for v in range(vocab)], dim=1)
    assert torch.equal(bits, want)
    assert torch.equal(bits[:, ::4], philox.philox_first_word(seed, groups, c1, c2, c3))


def test_race_noise_is_the_exponential_of_the_layouts_words():
    batch, vocab = 3, 4099
    randomness = Randomness(torch.tensor([5, -7, 2**40]), torch.tensor([0, 9, 2**32 - 1]), seed_per_row=False)
    stream = torch.tensor([philox.STREAM_POSITION, philox.STREAM_POSITION + 2, philox.STREAM_DRAFT])
    noise = race_noise(randomness, stream, vocab)
    for b in range(batch):
        for v in (0, 1, 2, 3, 2050, vocab - 3, vocab - 2, vocab - 1):
            bits = defined_word(int(randomness.seed[b]), v, b, int(randomness.offset[b]), int(stream[b]))
            assert noise[b, v] == philox.exponential_from_bits(torch.tensor(bits)), (b, v)


def layout_ids(vocab: int) -> list[int]:
    """8 ids: the first group, the middle one's, the last three (one or two groups as V % 4 is 1, 2, 3 or 0)."""
    ids = sorted({0, 1, 2, 3, vocab // 2 + 1, vocab - 3, vocab - 2, vocab - 1})
    assert len(ids) == 8, vocab
    return ids


def _race_logits(batch: int, rows: int, vocab: int, stride: int, dtype, device) -> torch.Tensor:
    """[batch, rows, vocab] logits, 0 at ``layout_ids`` and -inf elsewhere, in a buffer whose vocabulary rows are
    ``stride`` apart (an odd stride: rows that are not 16-byte aligned)."""
    buffer = torch.full((batch, rows, stride), float("-inf"), dtype=dtype, device=device)
    buffer[:, :, layout_ids(vocab)] = 0.0
    return buffer[:, :, :vocab]


def _expected_winners(randomness: Randomness, stream: int, vocab: int) -> list[int]:
    """Per row, the id of ``layout_ids`` whose exponential is the smallest (first on ties), from the definition."""
    ids = torch.tensor(layout_ids(vocab))
    batch = randomness.seed.shape[0]
    c1 = torch.zeros(batch, 1, dtype=torch.int64) if randomness.seed_per_row else torch.arange(batch).unsqueeze(1)
    bits = defined_words(randomness.seed.cpu().unsqueeze(1), ids.unsqueeze(0), c1, randomness.offset.cpu().unsqueeze(1),
                         stream)
    return ids[torch.argmin(philox.exponential_from_bits(bits), dim=1)].tolist()


def check_races_draw_the_layout(verify, sample, vocab: int, stride: int, seed_per_row: bool, dtype=torch.float32,
                                device="cpu", batch: int = 16):
    """The draft sampler (STREAM_DRAFT) and verify's race after a certain rejection (a one-hot q at an id of p = 0:
    STREAM_POSITION + 0) of ``verify`` / ``sample`` (the ops' contract) pick the id the layout's words make win."""
    g = torch.Generator().manual_seed(vocab * 2 + seed_per_row)
    seed = torch.randint(-2**63, 2**63 - 1, (batch,), generator=g)
    offset = torch.randint(0, 2**32, (batch,), generator=g)
    randomness = Randomness(seed.to(device), offset.to(device), seed_per_row)
    plain = Sampling(1.0, 0, 1.0)
    logits = _race_logits(batch, 1, vocab, stride, dtype, device)[:, 0]
    got = sample(logits, plain, randomness)
    assert got.tolist() == _expected_winners(randomness, philox.STREAM_DRAFT, vocab)
    target = _race_logits(batch, 2, vocab, stride, dtype, device)
    rejected = torch.full((batch, 1), vocab // 4, device=device)  # p = 0 there: always rejected (n = 0)
    tokens, num_accepted = verify(target, None, rejected, plain, randomness)
    assert num_accepted.tolist() == [0] * batch
    assert tokens[:, 0].tolist() == _expected_winners(randomness, philox.STREAM_POSITION, vocab)


# (V, row stride, seed per row): V % 4 = 1, 2, 3, 0; unaligned rows (odd strides) and 16-byte aligned ones
LAYOUT_CASES = [(65, 65, True), (66, 72, False), (67, 67, False), (68, 69, True), (1027, 1032, True)]


@pytest.mark.parametrize("vocab,stride,seed_per_row", LAYOUT_CASES, ids=str)
def test_reference_races_draw_the_layout(vocab, stride, seed_per_row):
    check_races_draw_the_layout(verify_reference, sample_reference, vocab, stride, seed_per_row)
