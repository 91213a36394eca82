"""The Triton backend (``ops/triton_backend.py``) against the torch reference.

Runs on a CUDA device, or on the CPU through the Triton interpreter (CI). Three levels, as for every sampler here:

* exact: greedy is bit-exact (ties included); sampling replays the reference's Philox numbers. Only float rounding
  can make a row differ: the kernels sum the softmax denominator chunk by chunk (another order than torch) and use
  other exp/log implementations (numpy's in the interpreter, libdevice on GPUs), and torch on CUDA divides by the
  temperature as x * (1/T). A decision changes only when r * q lies within an ulp of p or two race ratios lie within
  an ulp of each other (~1e-6 per row), so we require >= 99% identical rows; in practice all rows agree;
* statistical: the first emitted token follows the target p, P(accept first) = sum min(p, q), the token after a
  rejection follows max(0, p - q), the sampler follows the warped softmax (chi-square / binomial, seeded);
* invariants: q = 0 never accepted, -1 padding, same seed same result, per-row seeds independent of batch position,
  invalid rows flagged.

Interpreter runs cost ~50 ms per program, so the sizes are chosen to keep this file around two minutes.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or any kernel module is imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from scipy import stats  # noqa: E402

from speculative_kernels import ops  # noqa: E402
from speculative_kernels.ops import philox, triton_backend  # noqa: E402
from speculative_kernels.ops.randomness import Randomness  # noqa: E402
from speculative_kernels.ops.reference import sample_reference, verify_reference  # noqa: E402
from speculative_kernels.ops.sampling import GREEDY, Sampling  # noqa: E402
from speculative_kernels.ops.validation import check_sampling  # noqa: E402
from speculative_kernels.ops.triton_random import (  # noqa: E402
    exponential_from_bits,
    philox_first_word,
    philox_key,
    uniform_from_bits,
    vocabulary_bits,
)
from speculative_kernels.ops.warping import warp_logits  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers
from helpers.cuda_graphs import assert_seed_none_is_captured  # noqa: E402
from helpers.stats import assert_matches  # noqa: E402
import test_vocabulary_layout as layout  # noqa: E402  (tests/ops is on sys.path)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
MIN_AGREEMENT = 0.99
# Small tiles and many programs: every partial-combine path (several chunks per row, several race chunks).
SPLIT = triton_backend.Tuning(block_v=32, race_block_v=32, programs_per_sm=8, num_sms=2)
SPLIT_WIDE = triton_backend.Tuning(block_v=128, race_block_v=128, programs_per_sm=8, num_sms=2)
WARPS = {
    "plain": Sampling(1.0, 0, 1.0),
    "temp": Sampling(0.7, 0, 1.0),
    "topk": Sampling(0.7, 50, 1.0),
    "topp": Sampling(1.0, 0, 0.9),
    "both": Sampling(0.8, 20, 0.8),
}


# ---- helpers ----------------------------------------------------------------------------------------------------
def _rows(value, batch):
    return torch.full((batch,), value, dtype=torch.int64, device=DEVICE)


def _inputs(batch, k, vocab, dtype, seed, scale=2.0):
    """target [B, K+1, V], a correlated draft [B, K, V] (so drafts get accepted) and tokens drawn from the draft."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g) * scale
    draft = target[:, :k] + torch.randn(batch, k, vocab, generator=g) * (0.5 * scale)
    tokens = torch.multinomial(torch.softmax(draft.reshape(-1, vocab), -1), 1, generator=g).reshape(batch, k)
    return target.to(DEVICE, dtype), draft.to(DEVICE, dtype), tokens.to(DEVICE)


def _check_layout(tokens, num_accepted, draft_tokens, vocab):
    """Accepted drafts, then one emitted token in [0, V), then -1 padding; n in 0..K."""
    k = draft_tokens.shape[1]
    assert tokens.dtype == torch.int64 and num_accepted.dtype == torch.int64
    for row, n in enumerate(num_accepted.tolist()):
        assert 0 <= n <= k
        assert torch.equal(tokens[row, :n], draft_tokens[row, :n].to(torch.int64))
        assert 0 <= tokens[row, n] < vocab
        assert (tokens[row, n + 1:] == -1).all()


def _agreement(got, want):
    same = (got[0] == want[0]).all(dim=1) & (got[1] == want[1])
    return same.float().mean().item()


def _verify(*args, tuning=None, num_draft_tokens=None):
    return triton_backend.launch_verify(*args, tuning=tuning, num_draft_tokens=num_draft_tokens)


# ---- Philox and the float conversions, bit for bit --------------------------------------------------------------
@triton.jit
def _philox_probe(SEED_ptr, OUT_ptr, U_ptr, E_ptr, c1, c2, c3, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    v = tl.arange(0, BLOCK)
    k0, k1 = philox_key(tl.load(SEED_ptr))
    bits = philox_first_word(k0, k1, v.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32), c3.to(tl.uint32))
    tl.store(OUT_ptr + v, bits.to(tl.int64))
    tl.store(U_ptr + v, uniform_from_bits(bits))
    tl.store(E_ptr + v, exponential_from_bits(bits, PRECISE))


@pytest.mark.parametrize("seed", [0, 123456789, 2**62 + 12345])
def test_philox_and_conversions_match_reference(seed):
    block, c1, c2, c3 = 4096, 7, 2**32 - 5, philox.STREAM_DRAFT + 3
    seed_t = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
    bits = torch.empty(block, dtype=torch.int64, device=DEVICE)
    u, e = (torch.empty(block, dtype=torch.float32, device=DEVICE) for _ in range(2))
    _philox_probe[(1,)](seed_t, bits, u, e, c1, c2, c3, BLOCK=block, PRECISE=triton_backend.precise_math(bits.device))
    v = torch.arange(block, dtype=torch.int64, device=DEVICE)
    want = philox.philox_first_word(seed_t, v, torch.tensor(c1), torch.tensor(c2), torch.tensor(c3))
    assert torch.equal(bits, want)
    assert torch.equal(u, philox.uniform_from_bits(want))
    # The reference's float arithmetic (SLEEF log on CPU, CUDA's logf) may differ by an ulp from numpy's / libdevice's.
    torch.testing.assert_close(e, philox.exponential_from_bits(want), rtol=3e-7, atol=0)
    small = want.to(torch.float32) * 2.0**-32 < philox.EXP_SERIES_CUTOFF
    assert torch.equal(e[small], philox.exponential_from_bits(want)[small])  # the series is exact arithmetic


@triton.jit
def _vocabulary_bits_probe(SEED_ptr, OUT_ptr, first, c1, c2, c3, BLOCK: tl.constexpr):
    base = first + tl.program_id(0) * BLOCK
    k0, k1 = philox_key(tl.load(SEED_ptr))
    bits = vocabulary_bits(k0, k1, base, c1.to(tl.uint32), c2.to(tl.uint32), c3.to(tl.uint32), BLOCK)
    tl.store(OUT_ptr + base - first + tl.arange(0, BLOCK), bits.to(tl.int64))


@pytest.mark.parametrize("block", [16, 256])
def test_vocabulary_bits_match_reference(block):
    """Id v: word v % 4 of the call at v // 4, from tiles starting past 0 (as a race chunk's do)."""
    first, tiles, c1, c2, c3 = 4 * 1001, 3, 5, 2**32 - 3, philox.STREAM_POSITION + 2
    seed_t = torch.tensor([-98765432123], dtype=torch.int64, device=DEVICE)
    bits = torch.empty(tiles * block, dtype=torch.int64, device=DEVICE)
    _vocabulary_bits_probe[(tiles,)](seed_t, bits, first, c1, c2, c3, BLOCK=block)
    want = philox.vocabulary_bits(seed_t, first + tiles * block, torch.tensor(c1), torch.tensor(c2), torch.tensor(c3))
    assert torch.equal(bits, want[first:])


@pytest.mark.parametrize("vocab,stride,seed_per_row,tuning", [
    (1027, 1032, True, None), (67, 67, False, SPLIT)], ids=str)
def test_races_draw_the_vocabulary_layout(vocab, stride, seed_per_row, tuning):
    """The draft sampler's and verify's races pick the ids the layout's words make win (test_vocabulary_layout)."""
    layout.check_races_draw_the_layout(functools.partial(triton_backend.launch_verify, tuning=tuning),
                                       functools.partial(triton_backend.launch_sample, tuning=tuning), vocab, stride,
                                       seed_per_row, torch.bfloat16, DEVICE, batch=8)


# ---- greedy: bit-exact ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab,batch,k", [(3, 3, 4), (111, 3, 4), (1000, 1, 1), (8193, 3, 1), (32000, 1, 4)])
def test_greedy_bit_exact(dtype, vocab, batch, k):
    target, draft, tokens = _inputs(batch, k, vocab, dtype, seed=vocab)
    tokens[:, 0] = target[:, 0].float().argmax(-1)  # make acceptances happen
    args = (target, draft, tokens, GREEDY, Randomness(_rows(0, batch), _rows(0, batch), False))
    got = _verify(*args)
    want = verify_reference(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check_layout(*got, tokens, vocab)


@pytest.mark.parametrize("tuning", [None, SPLIT], ids=["default", "split"])
def test_greedy_ties_first_index(tuning):
    """bf16 logits with many repeated values (and maxima repeated across chunks): first index wins, as torch."""
    batch, k, vocab = 3, 4, 300
    g = torch.Generator().manual_seed(5)
    target = torch.randint(-3, 4, (batch, k + 1, vocab), generator=g).to(torch.bfloat16).to(DEVICE)
    target[:, :, 250] = 9.0  # ties with the in-chunk maxima below, in a later chunk
    target[:, :, 200] = 9.0
    target[1, 2, 100] = 9.0
    tokens = torch.tensor([[200, 200, 200, 200], [200, 200, 100, 7], [200, 250, 0, 0]], device=DEVICE)
    args = (target, None, tokens, GREEDY, Randomness(_rows(0, batch), _rows(0, batch), False))
    got = _verify(*args, tuning=tuning)
    want = verify_reference(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].tolist() == [4, 3, 1]


# ---- sampling: replay of the reference's random numbers ---------------------------------------------------------
REPLAY_CASES = [
    # vocab, dtype, batch, k, warp, one-hot draft, tuning
    (3, torch.float32, 3, 4, "plain", False, None),
    (111, torch.bfloat16, 3, 4, "both", False, SPLIT),
    (111, torch.float16, 3, 1, "temp", True, SPLIT),
    (1000, torch.float32, 3, 4, "topk", False, SPLIT_WIDE),
    (1000, torch.bfloat16, 1, 4, "topp", True, None),
    (8193, torch.float16, 3, 1, "plain", False, None),
    (8193, torch.bfloat16, 1, 4, "both", False, None),
    (32000, torch.bfloat16, 1, 1, "temp", False, None),
    (32000, torch.float32, 1, 4, "plain", True, None),
]


@pytest.mark.parametrize("vocab,dtype,batch,k,warp,one_hot,tuning", REPLAY_CASES, ids=str)
def test_sampling_replays_reference(vocab, dtype, batch, k, warp, one_hot, tuning):
    target, draft, tokens = _inputs(batch, k, vocab, dtype, seed=vocab + k)
    draft = None if one_hot else draft
    seed = torch.arange(batch, dtype=torch.int64, device=DEVICE) * 7919 + 3
    args = (target, draft, tokens, WARPS[warp], Randomness(seed, _rows(11, batch), batch > 1))
    got = _verify(*args, tuning=tuning)
    _check_layout(*got, tokens, vocab)
    assert _agreement(got, verify_reference(*args)) >= MIN_AGREEMENT


def test_sampling_replays_reference_many_rows():
    """Many rows of a small vocabulary, so that decisions vary (both accept and reject paths)."""
    batch, k, vocab = 32, 2, 13
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=1, scale=1.0)
    args = (target, draft, tokens, Sampling(0.9, 0, 0.95), Randomness(_rows(42, batch), _rows(3, batch), False))
    got = _verify(*args)
    want = verify_reference(*args)
    _check_layout(*got, tokens, vocab)
    assert _agreement(got, want) >= MIN_AGREEMENT
    assert len(set(got[1].tolist())) > 1  # both accept and reject paths were exercised


@pytest.mark.parametrize("vocab,warp,tuning", [(3, "plain", None), (1000, "both", SPLIT), (32000, "temp", None)],
                         ids=str)
def test_sample_replays_reference(vocab, warp, tuning):
    batch = 3
    logits = _inputs(batch, 1, vocab, torch.bfloat16, seed=vocab)[0][:, 0]
    seed = torch.tensor([1, 2, 3], device=DEVICE)
    args = (logits, WARPS[warp], Randomness(seed, _rows(5, batch), True))
    got = triton_backend.launch_sample(*args, tuning=tuning)
    assert got.shape == (batch,) and got.dtype == torch.int64
    assert (got == sample_reference(*args)).float().mean().item() >= MIN_AGREEMENT
    randomness = Randomness(seed, _rows(5, batch), True)
    greedy = triton_backend.launch_sample(logits, GREEDY, randomness, tuning=tuning)
    assert torch.equal(greedy, sample_reference(logits, GREEDY, randomness))


def test_strides_mixed_dtypes_and_int32_tokens():
    batch, k, vocab = 3, 2, 257
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=9)
    wide = torch.zeros(batch, k + 3, 2 * vocab, device=DEVICE)
    wide[:, 1:k + 2, 5:5 + vocab] = target
    strided_target = wide[:, 1:k + 2, 5:5 + vocab]  # non-contiguous rows
    column_draft = draft.transpose(1, 2).contiguous().transpose(1, 2).to(torch.bfloat16)  # vocab stride != 1
    args = (strided_target, column_draft, tokens.to(torch.int32), Sampling(0.9, 10, 0.9),
            Randomness(_rows(1, batch), _rows(2, batch), False))
    got = _verify(*args, tuning=SPLIT)
    want = verify_reference(target, column_draft.contiguous(), tokens, *args[3:])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- statistical tests of the Triton backend alone --------------------------------------------------------------
# On a GPU only: under the CPU interpreter these three took ~60 s of CI's CPU time (200 rows of three kernels,
# each program interpreted), and there they are implied by what runs on the CPU: the replay tests hold the Triton
# kernels to the torch reference bit for bit (same Philox draws), and test_verify_reference.py tests the reference's
# own distributions (first token, accept rate, one-hot drafts, the draft sampler) with many more rows.
statistics_on_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="on a GPU only: the CPU runs the bit-exact replays against the reference, whose statistics "
           "test_verify_reference.py tests")
P0 = torch.tensor([3.0, 0.5, 0.5, 0.5, 0.2, -1.0])  # target logits at position 0: p heavy on token 0
Q0 = torch.tensor([0.2, 3.0, 0.5, 0.5, 0.2, -1.0])  # draft logits: q heavy on token 1


def _stat_run(batch, one_hot):
    """``batch`` independent rows (row id in the Philox counter) of one fixed (p, q) problem, K = 2."""
    k, vocab = 2, P0.numel()
    target = torch.stack([P0, P0.flip(0), P0]).expand(batch, k + 1, vocab).to(DEVICE)
    draft = torch.stack([Q0, Q0.flip(0)]).expand(batch, k, vocab).to(DEVICE)
    # Draft tokens drawn from q (the guarantee needs x ~ q); fixed per row, seeded.
    g = torch.Generator().manual_seed(17)
    q = torch.softmax(draft[0].cpu(), -1)
    tokens = torch.multinomial(q, batch, replacement=True, generator=g).T.contiguous().to(DEVICE)
    if one_hot:
        draft = None
    out, n = _verify(target, draft, tokens, Sampling(1.0, 0, 1.0),
                     Randomness(_rows(2024, batch), _rows(0, batch), False))
    return out.cpu(), n.cpu(), tokens.cpu(), torch.softmax(P0, -1), q[0]


@statistics_on_gpu
def test_first_token_accept_rate_and_residual():
    """x_0 ~ q: the first emitted token follows p; P(accept) = sum min(p, q); after a rejection the token follows
    max(0, p - q). Checked by breaking the kernel on purpose: swapping p/q in the accept test, drawing the residual
    from p, or an off-by-one in n fails here (and the replay tests). Dropping the max(0, .) does not change any
    output of an exponential race: negative weights give negative ratios, which always lose to the >= 0 ones."""
    batch = 200
    out, n, tokens, p, q = _stat_run(batch, one_hot=False)
    assert_matches(np.bincount(out[:, 0].numpy(), minlength=p.numel()), p.numpy())
    accept_rate = torch.minimum(p, q).sum().item()
    accepted = int((n >= 1).sum())
    assert stats.binomtest(accepted, batch, accept_rate).pvalue > 1e-4, (accepted, batch, accept_rate)
    residual = torch.clamp(p - q, min=0)
    rejected = out[n == 0, 0]
    assert_matches(np.bincount(rejected.numpy(), minlength=p.numel()), (residual / residual.sum()).numpy())


@statistics_on_gpu
def test_one_hot_draft_first_token_follows_target():
    """draft_logits=None: q is one-hot at x, accept with probability p(x); the first token still follows p."""
    batch = 150
    out, n, tokens, p, _ = _stat_run(batch, one_hot=True)
    assert_matches(np.bincount(out[:, 0].numpy(), minlength=p.numel()), p.numpy())
    accept_rate = (p[tokens[:, 0]]).mean().item()
    assert stats.binomtest(int((n >= 1).sum()), batch, accept_rate).pvalue > 1e-4


@statistics_on_gpu
def test_sample_follows_warped_softmax():
    """The draft sampler follows softmax(warp(logits)); tokens cut by top-k/top-p never appear."""
    batch, vocab = 200, 8
    logits = torch.linspace(2.0, -2.0, vocab).expand(batch, vocab).to(DEVICE)
    seed = torch.arange(batch, dtype=torch.int64, device=DEVICE) + 99
    temperature, top_k, top_p = 0.8, 5, 0.9
    got = triton_backend.launch_sample(logits, Sampling(temperature, top_k, top_p),
                                       Randomness(seed, _rows(0, batch), True))
    probs = torch.softmax(warp_logits(logits[:1].cpu(), temperature, top_k, top_p), -1)[0]
    assert_matches(np.bincount(got.cpu().numpy(), minlength=vocab), probs.numpy())


# ---- invariants ---------------------------------------------------------------------------------------------------
def test_zero_probability_tokens_never_accepted():
    """q(x) = 0 (draft -inf there, or cut by top-k) is never accepted; neither is p(x) = 0."""
    batch, k, vocab = 8, 2, 50
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=4)
    tokens[:, 0] = 7
    draft[:, 0, 7] = float("-inf")
    out, n = _verify(target, draft, tokens, Sampling(1.0, 0, 1.0), Randomness(_rows(1, batch), _rows(0, batch), False))
    assert (n == 0).all() and (out[:, 0] != 7).all()
    target[:, 0, 7] = float("-inf")
    draft[:, 0, 7] = 0.0
    out, n = _verify(target, draft, tokens, Sampling(1.0, 0, 1.0), Randomness(_rows(1, batch), _rows(0, batch), False))
    assert (n == 0).all() and (out[:, 0] != 7).all()
    tokens[:, 0] = draft[:, 0].argmin(-1)  # cut by top-k in q (and hence q = 0)
    out, n = _verify(target, draft, tokens, Sampling(1.0, 5, 1.0), Randomness(_rows(1, batch), _rows(0, batch), False))
    assert (n == 0).all()


@pytest.mark.parametrize("tuning", [None, SPLIT], ids=["default", "split"])
def test_zero_residual_falls_back_to_p(tuning):
    """q == p and a draft token outside the top-k (p = q = 0): rejected at 0 with an all-zero residual, so the token
    is drawn from p_0 (a race over the zero residual would return id 0, which is kept out of the top-k here)."""
    batch, k, vocab, top_k = 8, 2, 200, 5
    target, _, _ = _inputs(batch, k, vocab, torch.bfloat16, seed=11)
    target[..., 0] = -20.0
    draft = target[:, :k].clone()
    tokens = target[:, :k].float().argmin(dim=-1)
    args = (target, draft, tokens, Sampling(0.9, top_k, 1.0),
            Randomness(torch.arange(batch, device=DEVICE) + 5, _rows(2, batch), True))
    out, n = _verify(*args, tuning=tuning)
    assert (n == 0).all()
    kth = target[:, 0].float().topk(top_k, dim=-1).values[:, -1]  # ties with the k-th value are kept too
    assert (target[:, 0].float().gather(1, out[:, :1]).squeeze(1) >= kth).all()
    assert _agreement((out, n), verify_reference(*args)) >= MIN_AGREEMENT


def test_same_seed_same_result_and_batch_position_independence():
    batch, k, vocab = 4, 3, 64
    target, draft, tokens = _inputs(batch, k, vocab, torch.bfloat16, seed=8)
    seed = torch.tensor([11, 22, 33, 44], device=DEVICE)
    offset = torch.tensor([0, 1, 2, 3], device=DEVICE)
    args = (target, draft, tokens, Sampling(0.9, 0, 1.0), Randomness(seed, offset, True))
    first = _verify(*args)
    assert all(torch.equal(a, b) for a, b in zip(first, _verify(*args)))
    order = torch.tensor([2, 0, 3, 1], device=DEVICE)
    permuted = _verify(target[order], draft[order], tokens[order], Sampling(0.9, 0, 1.0),
                       Randomness(seed[order], offset[order], True))
    assert torch.equal(permuted[0], first[0][order]) and torch.equal(permuted[1], first[1][order])
    alone = _verify(target[2:3], draft[2:3], tokens[2:3], Sampling(0.9, 0, 1.0),
                    Randomness(seed[2:3], offset[2:3], True))
    assert torch.equal(alone[0][0], first[0][2])


# ---- invalid rows -------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in the flagged rows
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_invalid_rows_flagged(temperature):
    batch, k, vocab = 6, 2, 40
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=6)
    target[1, 2, 5] = float("nan")
    draft[2, 0, 3] = float("inf")
    target[3, 1] = float("-inf")
    tokens[4, 1] = vocab
    tokens[5, 0] = -1
    args = (target, draft, tokens, Sampling(temperature, 0, 1.0), Randomness(_rows(3, batch), _rows(0, batch), False))
    out, n = _verify(*args)
    want = verify_reference(*args)
    assert n[1:].tolist() == [-1] * 5 and (out[1:] == -1).all()
    assert torch.equal(out, want[0]) and torch.equal(n, want[1])
    sampled = triton_backend.launch_sample(target[:, 1], Sampling(temperature, 0, 1.0),
                                           Randomness(_rows(3, batch), _rows(0, batch), False))
    assert sampled[3] == -1 and (sampled[[0, 2, 4, 5]] >= 0).all()


def test_public_op_uses_triton_and_raises_for_invalid_rows():
    batch, k, vocab = 2, 2, 30
    target, draft, tokens = _inputs(batch, k, vocab, torch.bfloat16, seed=2)
    got = ops.verify(target, draft, tokens, temperature=0.8, top_k=5, seed=3, offset=1, backend="triton")
    seeds, offsets = _rows(3, batch), _rows(1, batch)
    want = verify_reference(target, draft, tokens, Sampling(0.8, 5, 1.0), Randomness(seeds, offsets, False))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    target[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="target_logits"):
        ops.verify(target, draft, tokens, temperature=0.8, seed=3, backend="triton")
    with pytest.raises(ValueError, match="logits"):
        ops.sample(target[:, 0], seed=3, backend="triton")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy division
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("warp", [dict(top_k=0, top_p=1.0), dict(top_k=3, top_p=0.9)])
def test_logits_that_overflow_when_scaled_are_flagged(warp):
    """A finite logit that overflows float32 when divided by the temperature flags its row, as in the reference
    (it used to become token 0); a -3e38 logit that only leaves its own entry at -inf does not."""
    batch, k, vocab = 3, 1, 24
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=9)
    target[0, 1, 4] = 3e38
    draft[1, 0, 2] = 3e38
    target[2, 0, 7] = -3e38
    args = (target, draft, tokens, Sampling(0.5, warp["top_k"], warp["top_p"]),
            Randomness(_rows(3, batch), _rows(0, batch), False))
    out, n = _verify(*args)
    want = verify_reference(*args)
    assert n.tolist()[:2] == [-1, -1] and n.tolist()[2] >= 0
    assert torch.equal(out, want[0]) and torch.equal(n, want[1])
    sampled = triton_backend.launch_sample(target[:, 1], Sampling(0.5, warp["top_k"], warp["top_p"]),
                                           Randomness(_rows(3, batch), _rows(0, batch), False))
    assert sampled.tolist()[0] == -1 and (sampled[1:] >= 0).all()


# ---- GPU only: full-size vocabularies, CUDA graphs, no host synchronisation -----------------------------------------
gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (CI has none; the interpreter is too slow)")


@gpu
@pytest.mark.parametrize("warp", ["plain", "both"])
def test_large_vocab_on_gpu(warp):
    batch, k, vocab = 64, 8, 151936
    target, draft, tokens = _inputs(batch, k, vocab, torch.bfloat16, seed=151)
    seed = torch.arange(batch, device=DEVICE) + 1
    greedy_args = (target, draft, tokens, GREEDY, Randomness(seed, _rows(0, batch), True))
    got, want = _verify(*greedy_args), verify_reference(*greedy_args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    args = (target, draft, tokens, WARPS[warp], Randomness(seed, _rows(4, batch), True))
    got = _verify(*args)
    _check_layout(*got, tokens, vocab)
    assert _agreement(got, verify_reference(*args)) >= MIN_AGREEMENT


@gpu
@pytest.mark.parametrize("warp", ["plain", "both"])
def test_cuda_graph_capture_without_host_sync(warp):
    batch, k, vocab = 4, 4, 32000
    target, draft, tokens = _inputs(batch, k, vocab, torch.bfloat16, seed=3)
    seed, offset = _rows(7, batch), _rows(0, batch)
    args = (target, draft, tokens, WARPS[warp], Randomness(seed, offset, False))
    eager = triton_backend.verify(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation inside the op raises
    try:
        triton_backend.verify(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_backend.verify(*args)
    offset.fill_(0)
    graph.replay()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    offset.fill_(1)  # device-side offsets are read at replay time
    graph.replay()
    want = triton_backend.verify(*args)
    assert torch.equal(captured[0], want[0]) and torch.equal(captured[1], want[1])


@gpu
def test_seed_none_inside_cuda_graph_capture():
    """seed=None inside a CUDA-graph capture gets a fresh device-drawn seed per replay."""
    assert_seed_none_is_captured("triton", DEVICE)


@gpu
def test_no_recompilation_for_new_batch_sizes_on_gpu():
    """The JIT's own caches: after B = 1 compiled each kernel, B = 2..8 and 64 compile nothing new."""
    from speculative_kernels.ops.triton_kernels import finish_greedy_kernel, stats_kernel
    from speculative_kernels.ops.triton_race import finish_sample_kernel, race_kernel

    kernels = (stats_kernel, finish_greedy_kernel, race_kernel, finish_sample_kernel)
    device = torch.cuda.current_device()

    def compiled():
        return sum(len(kernel.device_caches[device][0]) for kernel in kernels)

    def run(batch):
        target, draft, tokens = _inputs(batch, 4, 32000, torch.bfloat16, seed=batch)
        for temperature in (0.0, 0.8):
            _verify(target, draft, tokens, Sampling(temperature, 0, 1.0),
                    Randomness(_rows(1, batch), _rows(0, batch), False))

    run(1)
    after_first = compiled()
    for batch in (2, 3, 4, 5, 6, 7, 8, 64):
        run(batch)
    assert compiled() == after_first


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
@pytest.mark.parametrize("warp", ["plain", "both"])
def test_logits_on_second_device_with_first_current(warp):
    """Logits on cuda:1 (an HF device_map model's head) while cuda:0 is current: the launches must go to cuda:1."""
    batch, k, vocab = 3, 4, 32000
    target, draft, tokens = (t.to("cuda:1") for t in _inputs(batch, k, vocab, torch.bfloat16, seed=12))
    seed = torch.arange(batch, device="cuda:1") + 1
    offset = torch.full((batch,), 3, device="cuda:1")
    randomness = Randomness(seed, offset, True)
    for sampling in (GREEDY, WARPS[warp]):
        args = (target, draft, tokens, sampling, randomness)
        with torch.cuda.device(1):
            want = triton_backend.verify(*args)
            want_sample = triton_backend.sample(target[:, 0], sampling, randomness)
        with torch.cuda.device(0):
            got = triton_backend.verify(*args)
            got_sample = triton_backend.sample(target[:, 0], sampling, randomness)
        torch.cuda.synchronize("cuda:1")
        assert got[0].device == torch.device("cuda:1")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got_sample, want_sample)
        reference = verify_reference(*args)
        if sampling.greedy:
            assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
        else:
            assert _agreement(got, reference) >= MIN_AGREEMENT


# ---- the GPU build of the kernels ---------------------------------------------------------------------------------
needs_ptxas = pytest.mark.skipif(
    not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
    reason="this triton build ships no NVIDIA backend (ptxas) to compile with",
)


def _aot(*args: str) -> subprocess.CompletedProcess:
    """``python -m speculative_kernels.ops.triton_aot ARGS`` with real JIT functions (no interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is every version's default
    return subprocess.run([sys.executable, "-m", "speculative_kernels.ops.triton_aot", *args], env=env,
                          capture_output=True, text=True, timeout=600)


@needs_ptxas
def test_kernels_compile_for_hopper_as_the_jit_builds_them():
    """Every kernel compiles to sm_90 cubin (no GPU needed; catches code only the interpreter accepts), bound by the
    JIT's own binder from the backend's recorded launches, so with the JIT's 16-byte divisibility hints: the logits
    and the KV cache are read with 128-bit loads, as on the GPU (without the hints they were scalar loads). The
    prompt-lookup kernel too (it runs on CUDA devices, and was compiled by none of these checks)."""
    result = _aot("--quick")
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("ok sm_90")]
    names = {line.split()[2] for line in lines}
    assert names == {"stats_kernel", "race_kernel", "finish_greedy_kernel", "finish_sample_kernel", "scale_kernel",
                     "compact_kv_kernel", "prompt_lookup_kernel", "radix_pass_kernel", "find_kernel"}, result.stdout
    for line in lines:
        if line.split()[2] in ("stats_kernel", "race_kernel", "scale_kernel", "compact_kv_kernel"):
            assert "v4." in line.split("loads=")[1], line


@needs_ptxas
def test_one_compiled_variant_for_every_batch_size():
    """A server sees new batch sizes all the time: none may compile a new kernel variant. Triton's JIT binder, run
    on the backend's recorded launches for B = 1..8, 64, 128, must give one cache key per kernel and mode (the
    combine tile once followed B, and B-dependent integers were specialised on == 1 / % 16).

    V = 16384 on an H100's plan (its cost: the launch code's top-k/top-p sort of [B, K+1, V] on the host) still
    takes every B-dependent integer through each class the JIT specialises on: pass-1 chunks 8 (B <= 8), 2 (64), 1
    (128); race chunks 16 (% 16, B <= 8), 8 (64), 4 (128); B itself 1, odd, % 16; the workspace planes likewise.
    Each do_not_specialize entry of the kernels removed, and a combine tile following B, fails here (with V = 32000
    and B = 256 the race plane's went unnoticed). The prompt-lookup buffer is 4000 + B tokens wide: its row stride,
    set by a request's prompt length, was specialised on % 16 (two variants)."""
    result = _aot("--batches", "1", "2", "3", "4", "5", "6", "7", "8", "64", "128", "--vocab", "16384")
    counts = [line.split() for line in result.stdout.splitlines() if line.startswith("variants ")]
    assert len(counts) >= 20, result.stdout + result.stderr[-4000:]
    assert all(c[1] == "1" for c in counts), result.stdout
    assert result.returncode == 0, result.stderr[-4000:]


def test_recorded_launches_are_the_runtimes_whatever_torchs_default_dtype():
    """triton_aot's recorded per-row launches (what ``variants`` compiles and counts) built their temperatures with
    torch's default dtype: with float16 as default the per-row kernels were specialised for a float16 temperature
    pointer, a variant the backend never launches (it holds temperatures in float32/float64)."""
    from speculative_kernels.ops import triton_aot

    def signatures():
        return [(mode, launch.name, [a.dtype for a in launch.args if isinstance(a, torch.Tensor)])
                for mode, launch in triton_aot.record_verify_modes(2, 2, 64)]

    expected = signatures()
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        got = signatures()
    finally:
        torch.set_default_dtype(saved)
    assert got == expected


def test_launches_guard_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: every launch enters the tensors' device first (a GPU test below
    runs logits on cuda:1 with cuda:0 current)."""
    seen = []
    guard = triton_backend.device_guard
    monkeypatch.setattr(triton_backend, "device_guard", lambda device: (seen.append(device), guard(device))[1])
    target, draft, tokens = _inputs(1, 1, 16, torch.float32, seed=1)
    _verify(target, draft, tokens, GREEDY, Randomness(_rows(0, 1), _rows(0, 1), False))
    triton_backend.launch_sample(target[:, 0], Sampling(1.0, 0, 1.0), Randomness(_rows(0, 1), _rows(0, 1), False))
    assert seen == [target.device, target.device]


# ---- per-row draft limits and sampling parameters (issues 15, 16) -----------------------------------------------
# One row kind per batch entry: (temperature, top_k, top_p); greedy and sampled rows in one launch.
MIXED = [(0.5, 0, 1.0), (1.0, 0, 1.0), (1.5, 0, 1.0), (1.0, 3, 1.0), (0.9, 0, 0.7), (0.0, 0, 1.0)]


def _row_sampling(kinds, repeat=1, device=DEVICE):
    """Sampling with per-row tensors for ``kinds``, each repeated ``repeat`` times (as ``ops`` builds it)."""
    t, k, p = zip(*kinds)
    rep = (lambda values, dtype: torch.tensor(values, dtype=dtype).repeat_interleave(repeat).to(device))
    return check_sampling(rep(t, torch.float32), rep(k, torch.int64), rep(p, torch.float64), len(kinds) * repeat,
                          torch.device(device))


def _same(got, want):
    return all(torch.equal(a, b) for a, b in zip(got, want))


LIMIT_CASES = [  # (sampling name, one_hot, tuning)
    ("greedy", False, None), ("greedy", True, SPLIT), ("plain", False, SPLIT), ("both", True, None),
    ("both", False, SPLIT_WIDE), ("mixed", False, SPLIT), ("mixed", True, None),
]


def _limit_sampling(name, batch):
    if name == "greedy":
        return GREEDY
    if name == "mixed":
        return _row_sampling(MIXED * (batch // len(MIXED)))
    return WARPS[name]


@pytest.mark.parametrize("name,one_hot,tuning", LIMIT_CASES, ids=str)
def test_draft_limit_replays_reference(name, one_hot, tuning):
    """num_draft_tokens 0..K per row (0 and K included), against the reference: greedy bit-exact, sampling with the
    same random numbers."""
    batch, k, vocab = 6, 3, 111
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=41)
    tokens[:, 0] = target[:, 0].argmax(-1)  # accepted when greedy, so limits of 1+ matter
    limit = torch.tensor([0, 1, 2, 3, 3, 0], device=DEVICE)
    d = None if one_hot else draft
    args = (target, d, tokens, _limit_sampling(name, batch), Randomness(torch.arange(batch, device=DEVICE) + 3,
                                                                        _rows(2, batch), True))
    got = _verify(*args, tuning=tuning, num_draft_tokens=limit)
    want = verify_reference(*args, limit)
    assert (got[1] <= limit).all()
    if name == "greedy":
        assert _same(got, want)
    else:
        assert _agreement(got, want) >= MIN_AGREEMENT
    assert _same(_verify(*args, tuning=tuning, num_draft_tokens=_rows(k, batch)), _verify(*args, tuning=tuning))


def test_draft_limit_rows_past_it_never_read():
    """NaN logits and -1 draft tokens past n_b: no flag, and the result of clean inputs."""
    batch, k, vocab = 4, 3, 50
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=42)
    limit = torch.tensor([0, 1, 2, 3], device=DEVICE)
    randomness = Randomness(_rows(5, batch), _rows(0, batch), False)
    for sampling in (GREEDY, WARPS["both"]):
        clean = _verify(target, draft, tokens, sampling, randomness, num_draft_tokens=limit)
        j = torch.arange(k + 1, device=DEVICE).unsqueeze(0)
        dirty_target, dirty_draft, dirty_tokens = target.clone(), draft.clone(), tokens.clone()
        dirty_target[j > limit.unsqueeze(1)] = float("nan")
        dirty_draft[j[:, :k] >= limit.unsqueeze(1)] = float("nan")
        dirty_tokens[j[:, :k] >= limit.unsqueeze(1)] = -1
        got = _verify(dirty_target, dirty_draft, dirty_tokens, sampling, randomness, num_draft_tokens=limit)
        assert _same(got, clean)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_draft_limit_out_of_range_flagged(temperature):
    batch, k, vocab = 4, 2, 30
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=43)
    limit = torch.tensor([1, -1, k + 1, 2], device=DEVICE)
    args = (target, draft, tokens, Sampling(temperature, 0, 1.0), Randomness(_rows(1, batch), _rows(0, batch), False))
    out, n = _verify(*args, num_draft_tokens=limit)
    assert (n[1:3] == -1).all() and (out[1:3] == -1).all()
    want = verify_reference(*args, limit)
    assert torch.equal(n, want[1]) and torch.equal(out[[0, 3]], want[0][[0, 3]])
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[0, 2\]"):
        ops.verify(target, draft, tokens, temperature=temperature, seed=1, num_draft_tokens=limit, backend="triton")


@pytest.mark.parametrize("tuning", [None, SPLIT], ids=["default", "split"])
def test_per_row_parameters_replay_reference(tuning):
    """One launch of greedy rows and rows at three temperatures, with top-k and with top-p: verify (dense and
    one-hot q) and sample against the reference with the same random numbers."""
    batch, k, vocab = 2 * len(MIXED), 3, 111
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=44)
    tokens[::2, 0] = target[::2, 0].argmax(-1)
    sampling = _row_sampling(MIXED, 2)
    randomness = Randomness(_rows(9, batch), _rows(4, batch), False)
    for d in (draft, None):
        got = _verify(target, d, tokens, sampling, randomness, tuning=tuning)
        _check_layout(*got, tokens, vocab)
        want = verify_reference(target, d, tokens, sampling, randomness)
        greedy = sampling.rows.greedy
        assert torch.equal(got[0][greedy], want[0][greedy]) and torch.equal(got[1][greedy], want[1][greedy])
        assert _agreement(got, want) >= MIN_AGREEMENT
    got = triton_backend.launch_sample(target[:, 0], sampling, randomness, tuning)
    assert torch.equal(got, sample_reference(target[:, 0], sampling, randomness))


def test_per_row_row_alone_and_scalar_call_are_identical():
    """Per-row seeds: a row of a mixed batch equals that row alone ([1] tensors) and the scalar call with its values,
    bit for bit (same backend: the per-row path is the scalar path's arithmetic); with a draft limit too."""
    batch, k, vocab = len(MIXED), 2, 60
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=45)
    sampling = _row_sampling(MIXED)
    seed, offset = torch.arange(batch, device=DEVICE) * 13 + 1, torch.arange(batch, device=DEVICE)
    limit = torch.tensor([2, 1, 0, 2, 1, 2], device=DEVICE)
    full = _verify(target, draft, tokens, sampling, Randomness(seed, offset, True), num_draft_tokens=limit)
    sampled = triton_backend.launch_sample(target[:, 0], sampling, Randomness(seed, offset, True))
    for b, kind in enumerate(MIXED):
        one = slice(b, b + 1)
        randomness = Randomness(seed[one], offset[one], False)
        for alone in (_row_sampling([kind]), Sampling(*kind)):
            got = _verify(target[one], draft[one], tokens[one], alone, randomness, num_draft_tokens=limit[one])
            assert torch.equal(got[0][0], full[0][b]) and got[1][0] == full[1][b], (b, kind, alone)
            assert triton_backend.launch_sample(target[one, 0], alone, randomness)[0] == sampled[b]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the flagged rows' arithmetic
def test_per_row_invalid_values_flagged():
    batch, k, vocab = 4, 2, 30
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=46)
    bad = dict(temperature=torch.tensor([0.0, -1.0, 0.8, 0.8], device=DEVICE),
               top_k=torch.tensor([0, 0, -2, 0], device=DEVICE),
               top_p=torch.tensor([1.0, 1.0, 1.0, 0.5], device=DEVICE))
    out, n = ops.verify(target, draft, tokens, **bad, seed=2, backend="triton", check=False)
    assert (n[1:3] == -1).all() and (out[1:3] == -1).all() and (n[[0, 3]] >= 0).all()
    want = ops.verify(target, draft, tokens, **bad, seed=2, backend="torch", check=False)
    assert torch.equal(out, want[0]) and torch.equal(n, want[1])
    with pytest.raises(ValueError, match=r"temperature must be finite and >= 0.*batch rows \[1\]"):
        ops.verify(target, draft, tokens, **bad, seed=2, backend="triton")
    sampled = ops.sample(target[:, 0], **bad, seed=2, backend="triton", check=False)
    assert (sampled[1:3] == -1).all() and (sampled[[0, 3]] >= 0).all()


def test_per_row_tensors_of_any_stride_are_read_by_row():
    """A sliced or expanded (stride 0) per-row temperature / num_draft_tokens gives what its contiguous copy gives,
    as on the torch backend (the kernels read row b at offset b: they used to give row b another row's value)."""
    batch, k, vocab = 3, 2, 20
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=47)
    temperature = torch.tensor([0.5, 9.0, 2.0, 9.0, 0.25], device=DEVICE)[::2]
    limit = torch.tensor([1, 9, 0, 9, 2], device=DEVICE)[::2]
    cases = [dict(temperature=temperature), dict(temperature=temperature, num_draft_tokens=limit),
             dict(temperature=torch.zeros(1, device=DEVICE).expand(batch)),
             dict(temperature=0.8, num_draft_tokens=torch.ones(1, dtype=torch.int64, device=DEVICE).expand(batch))]
    for case in cases:
        dense = {name: value.contiguous() if isinstance(value, torch.Tensor) else value for name, value in case.items()}
        want = ops.verify(target, draft, tokens, **dense, seed=5, backend="torch")
        for given in (case, dense):
            got = ops.verify(target, draft, tokens, **given, seed=5, backend="triton")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case
    got = ops.sample(target[:, 0], temperature=temperature, seed=5, backend="triton")
    assert torch.equal(got, ops.sample(target[:, 0], temperature=temperature.contiguous(), seed=5, backend="torch"))


# ---- per-row features on the GPU: statistics, CUDA graphs ------------------------------------------------------------
PER_ROW_STAT_ROWS = 40_000


@gpu
@pytest.mark.parametrize("one_hot", [False, True])
def test_per_row_first_token_and_sample_follow_each_rows_target_on_gpu(one_hot):
    """One mixed batch: each row kind's first emitted token (with a draft) and its sampled token follow that row's
    warped target distribution (chi-square); greedy rows emit the argmax."""
    vocab, k, rows = 10, 2, PER_ROW_STAT_ROWS
    g = torch.Generator().manual_seed(47)
    target = (torch.randn(k + 1, vocab, generator=g) * 1.5).to(DEVICE)
    draft = (torch.randn(k, vocab, generator=g) * 1.5).to(DEVICE)
    t, kk, p = (torch.tensor(v).repeat_interleave(rows).to(DEVICE) for v in zip(*MIXED))
    params = dict(temperature=t.float(), top_k=kk, top_p=p.double())
    batch = len(MIXED) * rows
    target_b, draft_b = target.expand(batch, -1, -1), draft.expand(batch, -1, -1)
    if one_hot:
        tokens = torch.randint(0, vocab, (batch, k), device=DEVICE)
    else:
        tokens = torch.stack([ops.sample(draft_b[:, i].contiguous(), **params, seed=5, offset=i, backend="triton")
                              for i in range(k)], dim=1)
    out, _ = ops.verify(target_b, None if one_hot else draft_b, tokens, **params, seed=5, backend="triton")
    sampled = ops.sample(target_b[:, 0].contiguous(), **params, seed=6, backend="triton")
    for index, (temperature, top_k, top_p) in enumerate(MIXED):
        part = slice(index * rows, (index + 1) * rows)
        if temperature == 0.0:
            assert (sampled[part] == target[0].argmax()).all() and (out[part, 0] >= 0).all()
            continue
        probs = torch.softmax(warp_logits(target[0], temperature, top_k, top_p), -1).cpu().numpy()
        assert_matches(np.bincount(out[part, 0].cpu().numpy(), minlength=vocab), probs)
        assert_matches(np.bincount(sampled[part].cpu().numpy(), minlength=vocab), probs)


@gpu
def test_per_row_and_limit_capture_without_host_sync():
    """Per-row temperatures/top-k/top-p and num_draft_tokens are read from device tensors at replay time."""
    batch, k, vocab = 6, 4, 32000
    target, draft, tokens = _inputs(batch, k, vocab, torch.bfloat16, seed=48)
    sampling = _row_sampling(MIXED)
    randomness = Randomness(_rows(7, batch), _rows(0, batch), False)
    limit = torch.tensor([4, 3, 2, 1, 0, 4], device=DEVICE)
    args = (target, draft, tokens, sampling, randomness)
    eager = triton_backend.verify(*args, limit)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_backend.verify(*args, limit)
        triton_backend.sample(target[:, 0], sampling, randomness)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_backend.verify(*args, limit)
    graph.replay()
    assert _same(captured, eager)
    limit.copy_(torch.tensor([0, 1, 2, 3, 4, 0], device=DEVICE))
    sampling.rows.temperature.copy_(torch.tensor([0.0, 0.7, 0.0, 1.2, 1.0, 0.5], device=DEVICE))
    graph.replay()
    assert _same(captured, triton_backend.verify(*args, limit))


def _tied_and_colliding(batch, rows, vocab, dtype, seed, nan):
    """tied_logits [B, J, V] with two more rows of neighbouring values (1 + i ulps, a few of each: distinct x whose
    x / 3 or x / 3e38 collide; in bf16/fp16 a run of tiny values that round to the same subnormal z or to 0)."""
    from test_cuda_host_cut import tied_logits

    logits = tied_logits((batch, rows, vocab), dtype, seed=seed, nan=nan).view(-1, vocab)
    g = torch.Generator().manual_seed(seed)
    for row, base in ((-1, 1.0), (-2, 2.0**-20)):
        bits = torch.tensor(base, dtype=dtype).view(torch.int16 if dtype != torch.float32 else torch.int32)
        steps = torch.randint(0, 6, (vocab,), generator=g).to(bits.dtype)
        logits[row] = (bits + steps).view(dtype) * torch.where(torch.arange(vocab) % 7 == 0, -1, 1).to(dtype)
    return logits.view(batch, rows, vocab).to(DEVICE)


TEMPERATURES = (1.0, 0.7, 3.0, 1e-3, 1e-30, 3e38)  # (1e-30: overflow to +-inf; 3e38: subnormal and zero z)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_top_k_cut_from_the_raw_logits_is_warp_thresholds_cut(dtype, monkeypatch):
    """``triton_backend._cuts`` with one temperature and top-k alone (a radix select over the raw logits, the value
    the z of that element, no copy of z) gives bit for bit the (value, index) of ``warp_thresholds`` over the
    kernels' z: tied small integer logits with +-inf and overflow rows, neighbouring values, k = 1 and V - 1, T from 1e-30 to
    3e38. A NaN row's cut is unspecified (every backend flags the row): on an H200 (torch 2.11) the last of CUDA's
    bf16 topk of k = V - 1 came back the NaN element, where the float32 topk of z ends on a finite one, so the NaN row
    is left out of the comparison. The radix select (``triton_select``, its own tests: test_kth_largest_select.py)
    depends on the logits and k only: it runs once per k, and the other temperatures reuse its element (the
    interpreter takes ~1 s a select)."""
    from speculative_kernels.ops.warping import warp_thresholds

    batch, rows, vocab = 2, 5, 37
    logits = _tied_and_colliding(batch, rows, vocab, dtype, seed=6, nan=True)
    finite = ~logits.isnan().any(-1).reshape(-1)
    assert not finite.all()  # (the NaN row is there: what it gets is the kernels' business)
    plan = triton_backend.make_plan(batch, rows, vocab, triton_backend.default_tuning(torch.device(DEVICE)))
    selects, select = {}, triton_backend.kth_largest_index
    monkeypatch.setattr(triton_backend, "kth_largest_index",
                        lambda x, k, *a: selects[k] if k in selects else selects.setdefault(k, select(x, k, *a)))
    for temperature in TEMPERATURES:
        z = triton_backend._scaled(logits, Sampling(temperature, 0, 1.0), plan)
        for top_k in (1, 2, 5, vocab - 1):
            got = triton_backend._cuts(logits, Sampling(temperature, top_k, 1.0), plan)
            want = warp_thresholds(z, top_k, 1.0)
            assert torch.equal(got[0][finite].view(torch.int32), want[0][finite].view(torch.int32)), (temperature, top_k)
            assert torch.equal(got[1][finite], want[1].to(torch.int32)[finite]) and got[1].dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_top_k_top_p_cut_is_the_whole_vocabulary_cut(dtype):
    """``triton_backend._cuts`` with one temperature, top-k and top-p (a topk of k over the raw logits, z of the k
    candidates, ties with the k-th z counted without z: ``warping.scaled_equal``) gives bit for bit the cut of the
    whole-vocabulary definition over the kernels' z: tied logits with +-inf and overflow rows, neighbouring values
    whose z collide at T = 3 or 3e38, k = 1 and V - 1, top_p near 0 and 1, T from 1e-30 to 3e38. (A NaN row's cut
    is unspecified: every backend flags the row.)"""
    from test_top_k_top_p_cut import whole_vocabulary_cut

    batch, rows, vocab = 2, 5, 37
    logits = _tied_and_colliding(batch, rows, vocab, dtype, seed=8, nan=False)
    plan = triton_backend.make_plan(batch, rows, vocab, triton_backend.default_tuning(torch.device(DEVICE)))
    for temperature in TEMPERATURES:
        z = triton_backend._scaled(logits, Sampling(temperature, 0, 1.0), plan)
        for top_k, top_p in [(1, 0.5), (5, 0.9), (vocab - 1, 1e-9), (20, 0.9999999), (3, 0.3)]:
            got = triton_backend._cuts(logits, Sampling(temperature, top_k, top_p), plan)
            want = whole_vocabulary_cut(z, top_k, top_p)
            assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32)), (temperature, top_k, top_p)
            assert torch.equal(got[1], want[1]), (temperature, top_k, top_p)


def test_per_row_cut_from_a_host_bound_reaches_the_op(monkeypatch, dtype=torch.bfloat16):
    """``RowSampling.top_k_bound`` passes through the registered ops (their ``top_k_bound`` argument) to the per-row
    cut, which then takes one topk of the bound (``warping.rows_top_k_cut_of_logits``): the same tokens as the
    reference (whose per-row cut sorts each row), on tied logits with +-inf, overflow and a NaN row (flagged), a
    greedy row, a top-k-alone row."""
    import dataclasses
    from test_cuda_host_cut import tied_logits

    batch, k, vocab = 8, 2, 61
    target = tied_logits((batch, k + 1, vocab), dtype, seed=11, stride=k + 1).to(DEVICE)
    draft = tied_logits((batch, k, vocab), dtype, seed=12, stride=k).to(DEVICE)
    tokens = target[:, :k].float().nan_to_num().argmax(-1)
    t = torch.tensor([0.7, 1.0, 0.0, 1e-3, 1.3, 0.7, 1.0, 0.8], device=DEVICE)
    top_k = torch.tensor([1, 5, 0, 20, 12, 3, 20, 7], device=DEVICE)
    top_p = torch.tensor([0.5, 0.9, 0.3, 0.3, 1.0, 1e-9, 0.9999999, 0.9], dtype=torch.float64, device=DEVICE)
    sorted_rows = check_sampling(t, top_k, top_p, batch, torch.device(DEVICE))
    bounded = dataclasses.replace(sorted_rows, rows=dataclasses.replace(sorted_rows.rows, top_k_bound=20))

    def outputs(verify, sample, sampling):
        randomness = Randomness(_rows(5, batch), _rows(2, batch), False)
        return [*verify(target, draft, tokens, sampling, randomness), sample(target[:, 0], sampling, randomness)]

    bounds, real = [], triton_backend.rows_top_k_cut_of_logits
    monkeypatch.setattr(triton_backend, "rows_top_k_cut_of_logits", lambda *a: bounds.append(a[4]) or real(*a))
    got = outputs(triton_backend.verify, triton_backend.sample, bounded)
    assert bounds == [20] * 3  # (the bound reaches every cut: the target's and the draft's, the sample's)
    assert _same(got, outputs(verify_reference, sample_reference, sorted_rows))
    assert got[1][7] == -1 and got[2][7] == -1 and (got[1] >= 0).sum() >= 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_per_row_cut_from_a_host_bound_without_z_is_the_sorted_cut(dtype):
    """``triton_backend._cuts`` with per-row parameters and a host bound (a topk of the bound over the raw logits, z
    of the candidates with each row's temperature, ties counted by ``warping.scaled_equal``: no copy of z) gives bit
    for bit ``row_thresholds`` over the kernels' z without the bound (a V-length sort per row): tied and colliding
    logits with +-inf and overflow, row temperatures from 1e-30 to 3e38, greedy rows, top-k-alone rows."""
    import dataclasses
    from speculative_kernels.ops.warping import row_thresholds

    batch, rows, vocab = 10, 1, 37
    logits = _tied_and_colliding(batch, rows, vocab, dtype, seed=10, nan=False)
    t = torch.tensor([0.7, 1.0, 0.0, 1e-3, 3.0, 1e-30, 3e38, 0.8, 3.0, 3e38], device=DEVICE)
    top_k = torch.tensor([1, 5, 0, 20, 12, 3, 20, 7, 4, 20], device=DEVICE)
    top_p = torch.tensor([0.5, 0.9, 0.3, 0.3, 1.0, 1e-9, 0.9999999, 0.9, 0.6, 0.5], dtype=torch.float64,
                         device=DEVICE)
    sorted_rows = check_sampling(t, top_k, top_p, batch, torch.device(DEVICE))
    bounded = dataclasses.replace(sorted_rows, rows=dataclasses.replace(sorted_rows.rows, top_k_bound=20))
    plan = triton_backend.make_plan(batch, rows, vocab, triton_backend.default_tuning(torch.device(DEVICE)))
    z = triton_backend._scaled(logits, sorted_rows, plan)
    params = sorted_rows.rows
    want = row_thresholds(z, params.sampled_top_k(), params.sampled_top_p())
    got = triton_backend._cuts(logits, bounded, plan)
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.int32), triton_backend._cuts(logits, sorted_rows, plan)[0].view(torch.int32))



def test_top_k_cuts_write_no_copy_of_z_nor_of_the_logits():
    """``_cuts`` with one temperature and top-k (alone, with top-p) and per-row parameters with a host bound allocate
    no [B, J, V] float32 tensor (z) and no copy of the logits (a strided view, as a model's last positions, is not
    reshaped into a copy): every aten op's output recorded by a dispatch mode (views of the logits excepted)."""
    import dataclasses
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(t, torch.Tensor) and t.numel() >= logits.numel() and t.dtype in (torch.float32, dtype)
                        and t.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()):
                    self.big.append((str(func), t.dtype))
            return out

    batch, rows, vocab, dtype = 3, 2, 40, torch.bfloat16
    full = torch.randn(batch, rows + 3, vocab).to(DEVICE, dtype)
    logits = full[:, 1:1 + rows]  # [B, J, V], not contiguous
    rows_sampling = check_sampling(torch.tensor([0.7, 0.0, 1.3], device=DEVICE), torch.tensor([5, 0, 3], device=DEVICE),
                                   torch.tensor([0.9, 1.0, 0.5], dtype=torch.float64, device=DEVICE), batch,
                                   torch.device(DEVICE))
    bounded = dataclasses.replace(rows_sampling, rows=dataclasses.replace(rows_sampling.rows, top_k_bound=5))
    plan = triton_backend.make_plan(batch, rows, vocab, triton_backend.default_tuning(torch.device(DEVICE)))
    for sampling in (Sampling(0.7, 5, 1.0), Sampling(0.7, 5, 0.9), Sampling(1.0, 5, 0.9), bounded):
        with Outputs() as mode:
            triton_backend._cuts(logits, sampling, plan)
        assert mode.big == [], (sampling, mode.big)
