"""The CUDA backend (csrc/ via torch.ops.speculative_kernels_cuda) against the torch reference.

On a CUDA device:
* greedy is bit-exact (argmax of float32 logits, first index on ties) for every dtype / vocabulary / B / K;
* sampling replays the reference's random numbers. It is bit-exact wherever the float arithmetic is exact (constant
  logits: p = 1/V in both, so the Philox accept uniforms and race noise alone decide), and >= 99% of rows agree
  elsewhere: the kernels sum the softmax denominator in another order (chunked online softmax) than torch, the CPU
  reference uses SLEEF's expf/logf and the CUDA reference computes z = x / T as x * (1/T), so p and E can differ in
  the last bit, which changes a decision only when r * q lies within an ulp of p or two race ratios within an ulp of
  each other;
* statistical tests of the emitted tokens and the accepted count (the same as the reference's own tests), invariants
  (cut tokens never drawn, -1 padding, seed_per_row batch independence, determinism), invalid-row flags, strides,
  mixed dtypes, torch.compile(fullgraph=True) and CUDA-graph capture.

Without a CUDA device (CI): the loader's logic, the public ops' refusal, and the Python plumbing of the ops (schemas,
argument order, the top-k/top-p cut, fake implementations under torch.compile) against a CPU stand-in of the op.
"""

import importlib
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from speculative_kernels import ops
from speculative_kernels.ops import cuda_ext
from speculative_kernels.ops.randomness import Randomness
from speculative_kernels.ops.reference import sample_reference, verify_reference
from speculative_kernels.ops.sampling import GREEDY, Sampling
from speculative_kernels.ops.warping import apply_thresholds, kth_largest_index, warp_logits
from helpers.cuda_graphs import assert_seed_none_is_captured
from helpers.stats import assert_matches

ROOT = Path(__file__).resolve().parents[2]
BACKEND_MODULE = "speculative_kernels.ops.cuda_backend"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda"

VOCABS = [3, 111, 1000, 8193, 32000, 151936]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BATCHES = [1, 3, 64]
NUM_DRAFTS = [1, 4, 8]
REPLAY_SHAPES = [(1, 1), (1, 8), (3, 4), (64, 1), (64, 8)]
REPLAY_WARPS = [
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=0.7, top_k=50, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=0.9),
    dict(temperature=0.8, top_k=20, top_p=0.8),
]
MIN_REPLAY_ROWS = 128
MIN_AGREEMENT = 0.99

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (CI has none; test_cuda_build.py compiles the sources)")


@pytest.fixture(scope="module")
def backend():
    """The CUDA backend module; importing it loads or JIT-builds the extension (a failure there is an error)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    return importlib.import_module(BACKEND_MODULE)


# ---- helpers ----------------------------------------------------------------------------------------------------
def _rows(value: int, batch: int, device=DEVICE) -> torch.Tensor:
    return torch.full((batch,), value, dtype=torch.int64, device=device)


def _sampling(warp: dict) -> Sampling:
    return Sampling(warp["temperature"], warp["top_k"], warp["top_p"])


def _inputs(batch, k, vocab, dtype, seed, scale=2.0, device=DEVICE):
    """target [B, K+1, V], correlated draft [B, K, V] (so drafts get accepted) and tokens drawn from the draft."""
    g = torch.Generator(device=device).manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g, device=device) * scale
    draft = target[:, :k] + torch.randn(batch, k, vocab, generator=g, device=device) * (0.5 * scale)
    q = torch.softmax(draft.reshape(-1, vocab), dim=-1)
    tokens = torch.multinomial(q, 1, generator=g).reshape(batch, k)
    return target.to(dtype), draft.to(dtype), tokens


def _agreeing_rows(got, want) -> torch.Tensor:
    """[B] bool: rows whose tokens and num_accepted are identical."""
    tokens_got, n_got = (t.cpu() for t in got)
    tokens_want, n_want = (t.cpu() for t in want)
    return (tokens_got == tokens_want).all(dim=1) & (n_got == n_want)


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu()), f"\n{a}\n!=\n{b}"


def _assert_invariants(tokens, n, draft_tokens):
    """n in 0..K; accepted prefix = drafts; one emitted token in [0, V); -1 padding after it."""
    batch, num_positions = tokens.shape
    k = num_positions - 1
    assert ((n >= 0) & (n <= k)).all()
    pos = torch.arange(num_positions, device=tokens.device).unsqueeze(0)
    padded = torch.cat([draft_tokens.to(torch.int64), draft_tokens.new_full((batch, 1), -1).to(torch.int64)], 1)
    nn = n.unsqueeze(1)
    assert torch.equal(torch.where(pos < nn, tokens, 0), torch.where(pos < nn, padded, 0))
    assert (torch.where(pos > nn, tokens, -1) == -1).all()
    emitted = tokens.gather(1, n.unsqueeze(1)).squeeze(1)
    assert (emitted >= 0).all()


# ---- greedy: bit-exact --------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("k", NUM_DRAFTS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_bit_exact(backend, dtype, vocab, batch, k):
    target, draft, _ = _inputs(batch, k, vocab, dtype, seed=vocab * 7 + batch * 3 + k)
    g = torch.Generator(device=DEVICE).manual_seed(vocab + k)
    # Ties: copy each row's maximum to a random other id (the first index must win).
    best = target.float().argmax(dim=-1, keepdim=True)
    other = torch.randint(0, vocab, best.shape, generator=g, device=DEVICE)
    target.scatter_(-1, other, target.gather(-1, best))
    best = target.float().argmax(dim=-1)
    keep = torch.rand(batch, k, generator=g, device=DEVICE) < 0.8
    tokens = torch.where(keep, best[:, :k], torch.randint(0, vocab, (batch, k), generator=g, device=DEVICE))
    seed, offset = _rows(3, batch), _rows(0, batch)
    for d in (draft, None):
        got = backend.verify(target, d, tokens, GREEDY, Randomness(seed, offset, False))
        want = verify_reference(target, d, tokens, GREEDY, Randomness(seed, offset, False))
        _assert_same(got, want)
    got = backend.sample(target[:, 0], GREEDY, Randomness(seed, offset, False))
    _assert_same([got], [sample_reference(target[:, 0], GREEDY, Randomness(seed, offset, False))])


# ---- sampling: exact replay -----------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_logits_replay_bit_exact(backend, dtype, vocab):
    """p = 1/V exactly in both implementations: the Philox accept uniforms and the race noise alone decide, so the
    kernels must reproduce the reference bit for bit (c0/c1/c2/c3 layout, uniform, exponential, argmax ties)."""
    batch, k = 64, 4
    g = torch.Generator(device=DEVICE).manual_seed(vocab)
    target = torch.zeros(batch, k + 1, vocab, dtype=dtype, device=DEVICE)
    tokens = torch.randint(0, vocab, (batch, k), generator=g, device=DEVICE)
    seed = torch.randint(0, 2**62, (batch,), generator=g, device=DEVICE)
    offset = torch.randint(0, 2**32, (batch,), generator=g, device=DEVICE)
    for per_row in (False, True):
        out, n = backend.verify(target, None, tokens, Sampling(1.0, 0, 1.0), Randomness(seed, offset, per_row))
        _assert_same((out, n), verify_reference(target, None, tokens, Sampling(1.0, 0, 1.0),
                                                Randomness(seed, offset, per_row)))
        sampled = backend.sample(target[:, 0], Sampling(1.0, 0, 1.0), Randomness(seed, offset, per_row))
        _assert_same([sampled], [sample_reference(target[:, 0], Sampling(1.0, 0, 1.0),
                                                  Randomness(seed, offset, per_row))])
        assert (n < k).any()  # the residual race after a rejection is exercised
        if vocab == 3:  # P(accept) = 1/3: accepted prefixes and the bonus draw are exercised too
            assert (n > 0).any()


def _replay(backend, target, draft, tokens, warp, reference_device, per_row=False, min_rows=MIN_REPLAY_ROWS):
    """Fraction of rows identical to the reference over enough (seed, offset) repetitions; alternates dense/one-hot q."""
    batch = target.shape[0]
    same = total = 0
    to_ref = (lambda t: None if t is None else t.to(reference_device))
    for rep in range(-(-min_rows // batch)):
        d = draft if rep % 2 == 0 else None
        seed = torch.arange(batch, device=DEVICE) * 7919 + 1000 + rep
        offset = _rows(rep * 3 + 1, batch)
        got = backend.verify(target, d, tokens, _sampling(warp), Randomness(seed, offset, per_row))
        _assert_invariants(*got, tokens)
        want = verify_reference(to_ref(target), to_ref(d), to_ref(tokens), _sampling(warp),
                                Randomness(to_ref(seed), to_ref(offset), per_row))
        same += int(_agreeing_rows(got, want).sum())
        total += batch
    return same / total


@gpu
@pytest.mark.parametrize("batch,k", REPLAY_SHAPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sampling_replays_reference(backend, dtype, vocab, batch, k):
    warp = REPLAY_WARPS[VOCABS.index(vocab) % len(REPLAY_WARPS)]
    target, draft, tokens = _inputs(batch, k, vocab, dtype, seed=vocab + 31 * batch + k)
    agreement = _replay(backend, target, draft, tokens, warp, DEVICE, per_row=batch == 3)
    assert agreement >= MIN_AGREEMENT, f"only {agreement:.2%} of rows replay the CUDA reference ({warp})"


@gpu
@pytest.mark.parametrize("warp", REPLAY_WARPS, ids=str)
@pytest.mark.parametrize("vocab", [3, 111, 1000, 8193])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sampling_replays_cpu_reference(backend, dtype, vocab, warp):
    """Against the reference on CPU, the definition (true division z = x / T like the kernels)."""
    target, draft, tokens = _inputs(3, 4, vocab, dtype, seed=vocab + 5)
    agreement = _replay(backend, target, draft, tokens, warp, "cpu")
    assert agreement >= MIN_AGREEMENT, f"only {agreement:.2%} of rows replay the CPU reference ({warp})"


@gpu
@pytest.mark.parametrize("vocab", [3, 1000, 151936])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sample_replays_reference(backend, dtype, vocab):
    logits = _inputs(64, 1, vocab, dtype, seed=vocab)[0][:, 0]
    same = total = 0
    for rep, warp in enumerate(REPLAY_WARPS * 2):
        seed, offset = _rows(rep + 17, 64), _rows(rep, 64)
        got = backend.sample(logits, _sampling(warp), Randomness(seed, offset, rep % 2 == 1))
        assert ((got >= 0) & (got < vocab)).all()
        want = sample_reference(logits, _sampling(warp), Randomness(seed, offset, rep % 2 == 1))
        same += int((got == want).sum())
        total += 64
    assert same / total >= MIN_AGREEMENT


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_residual_falls_back_to_p(backend, dtype):
    """q == p and a draft token outside the top-k (p = q = 0): rejected at 0 with an all-zero residual, so the token
    is drawn from p_0 (a race over the zero residual would return id 0, which is kept out of the top-k here)."""
    batch, k, vocab = 64, 2, 1000
    target, _, _ = _inputs(batch, k, vocab, dtype, seed=11)
    target[..., 0] = -20.0
    draft = target[:, :k].clone()
    tokens = target[:, :k].float().argmin(dim=-1)
    warp = dict(temperature=0.9, top_k=5, top_p=1.0)
    seed, offset = torch.arange(batch, device=DEVICE) + 5, _rows(2, batch)
    out, n = backend.verify(target, draft, tokens, _sampling(warp), Randomness(seed, offset, False))
    assert (n == 0).all()
    kth = target[:, 0].float().topk(5, dim=-1).values[:, -1]  # ties with the 5th value are kept too
    assert (target[:, 0].float().gather(1, out[:, :1]).squeeze(1) >= kth).all()
    want = verify_reference(target, draft, tokens, _sampling(warp), Randomness(seed, offset, False))
    assert _agreeing_rows((out, n), want).float().mean() >= MIN_AGREEMENT


# ---- statistics (the reference's own distribution tests, on the kernels) -------------------------------------------
STAT_ROWS = 40_000
STAT_WARPS = [
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=0.7, top_k=0, top_p=1.0),
    dict(temperature=1.3, top_k=4, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=0.8),
    dict(temperature=0.9, top_k=5, top_p=0.9),
]


def _stat_logits(k, vocab, seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, vocab, generator=g) * scale).to(DEVICE)


def _probs(logits, warp):
    return torch.softmax(warp_logits(logits, warp["temperature"], warp["top_k"], warp["top_p"]), dim=-1).cpu()


def _draft_and_verify(target_rows, draft_rows, warp, seed=0):
    """STAT_ROWS verifications of the same logits (expanded: batch stride 0); drafts drawn with the CUDA sampler."""
    k = draft_rows.shape[0]
    target = target_rows.expand(STAT_ROWS, -1, -1)
    draft = draft_rows.expand(STAT_ROWS, -1, -1)
    tokens = torch.stack(
        [ops.sample(draft[:, i], **warp, seed=seed, offset=i, backend="cuda") for i in range(k)], dim=1
    )
    out, n = ops.verify(target, draft, tokens, **warp, seed=seed, offset=0, backend="cuda")
    _assert_invariants(out, n, tokens)
    return tokens, out.cpu(), n.cpu()


@gpu
@pytest.mark.parametrize("warp", STAT_WARPS, ids=str)
def test_first_token_follows_target(backend, warp):
    vocab, k = 8, 3
    target, draft = _stat_logits(k + 1, vocab, 1), _stat_logits(k, vocab, 2)
    _, out, _ = _draft_and_verify(target, draft, warp)
    assert_matches(np.bincount(out[:, 0].numpy(), minlength=vocab), _probs(target[0], warp).numpy())


@gpu
@pytest.mark.parametrize("warp", STAT_WARPS, ids=str)
def test_accepted_count_follows_theory(backend, warp):
    """P(n >= i) = prod_{j<i} sum_v min(p_j, q_j): catches q/p swaps and off-by-one accepted counts."""
    vocab, k = 8, 4
    target, draft = _stat_logits(k + 1, vocab, 3), _stat_logits(k, vocab, 4)
    _, _, n = _draft_and_verify(target, draft, warp)
    p, q = _probs(target, warp), _probs(draft, warp)
    beta = torch.minimum(p[:k], q).sum(dim=-1).double().numpy()
    survive = np.concatenate([[1.0], np.cumprod(beta)])
    expected = np.append(survive[:-1] * (1 - beta), survive[-1])
    assert_matches(np.bincount(n.numpy(), minlength=k + 1), expected)


@gpu
def test_emitted_token_after_rejection_is_residual(backend):
    """Rows rejected at 0 emit from norm(max(0, p0 - q0)) (catches a missing max(0, .) and p/q swaps)."""
    vocab, k = 6, 2
    warp = STAT_WARPS[0]
    target, draft = _stat_logits(k + 1, vocab, 5, scale=2.0), _stat_logits(k, vocab, 6, scale=2.0)
    _, out, n = _draft_and_verify(target, draft, warp)
    p, q = _probs(target, warp), _probs(draft, warp)
    rejected = n == 0
    assert rejected.sum() > 1000
    residual = torch.clamp(p[0] - q[0], min=0)
    assert_matches(np.bincount(out[rejected, 0].numpy(), minlength=vocab), residual.numpy())


@gpu
@pytest.mark.parametrize("warp", STAT_WARPS[::2], ids=str)
def test_one_hot_draft_first_token_follows_target(backend, warp):
    """draft_logits=None (one-hot q) with uniformly random proposals: the first emitted token is still ~ p_0."""
    vocab, k = 8, 3
    target = _stat_logits(k + 1, vocab, 7)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    tokens = torch.randint(0, vocab, (STAT_ROWS, k), generator=g, device=DEVICE)
    out, n = ops.verify(target.expand(STAT_ROWS, -1, -1), None, tokens, **warp, seed=3, backend="cuda")
    _assert_invariants(out, n, tokens)
    assert_matches(np.bincount(out[:, 0].cpu().numpy(), minlength=vocab), _probs(target[0], warp).numpy())


@gpu
@pytest.mark.parametrize("warp", STAT_WARPS, ids=str)
def test_sample_follows_warped_softmax(backend, warp):
    vocab = 300
    logits = _stat_logits(1, vocab, 8)
    tokens = ops.sample(logits.expand(STAT_ROWS, -1), **warp, seed=4, backend="cuda").cpu()
    assert_matches(np.bincount(tokens.numpy(), minlength=vocab), _probs(logits[0], warp).numpy())


# ---- invariants ------------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cut_tokens_never_emitted(backend, dtype):
    batch, k, vocab, top_k = 64, 4, 32000, 3
    target, draft, tokens = _inputs(batch, k, vocab, dtype, seed=21)
    rows = torch.arange(batch, device=DEVICE)
    for d in (draft, None):
        out, n = backend.verify(target, d, tokens, Sampling(1.0, top_k, 1.0),
                                Randomness(_rows(9, batch), _rows(0, batch), False))
        kth = target.float().topk(top_k, dim=-1).values[..., -1]  # [B, K+1]; ties with it are kept
        emitted = out.gather(1, n.unsqueeze(1)).squeeze(1)
        assert (target.float()[rows, n, emitted] >= kth[rows, n]).all()


@gpu
def test_seed_per_row_is_batch_independent_and_deterministic(backend):
    vocab, k = 8193, 4
    target, draft, tokens = _inputs(3, k, vocab, torch.bfloat16, seed=13)
    seed = torch.tensor([11, 22, 33], device=DEVICE)
    offset = torch.tensor([1, 2, 3], device=DEVICE)
    sampling = Sampling(0.8, 20, 0.9)
    full = backend.verify(target, draft, tokens, sampling, Randomness(seed, offset, True))
    _assert_same(full, backend.verify(target, draft, tokens, sampling, Randomness(seed, offset, True)))
    order = torch.tensor([2, 0], device=DEVICE)
    part = backend.verify(target[order], draft[order], tokens[order], sampling,
                          Randomness(seed[order], offset[order], True))
    _assert_same((full[0][order], full[1][order]), part)
    sampled = backend.sample(target[:, 0], sampling, Randomness(seed, offset, True))
    _assert_same([sampled[order]], [backend.sample(target[order, 0], sampling,
                                                   Randomness(seed[order], offset[order], True))])


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strides_and_layouts(backend, dtype):
    batch, k, vocab = 3, 4, 1000
    target, draft, tokens = _inputs(batch, k, vocab, dtype, seed=17)
    seed, offset = _rows(5, batch), _rows(7, batch)
    # batch/position strides permuted (vector path), vocab stride != 1 (copied by the binding), expanded seed.
    permuted = target.transpose(0, 1).contiguous().transpose(0, 1)
    vocab_strided = target.transpose(1, 2).contiguous().transpose(1, 2)
    for temperature in (0.0, 0.8):
        ref = backend.verify(target, draft, tokens, Sampling(temperature, 20, 0.9), Randomness(seed, offset, False))
        for t in (permuted, vocab_strided):
            _assert_same(backend.verify(t, draft, tokens, Sampling(temperature, 20, 0.9),
                                        Randomness(seed, offset, False)), ref)
        _assert_same(backend.verify(target, draft, tokens.to(torch.int32), Sampling(temperature, 20, 0.9),
                                    Randomness(seed, offset, False)), ref)
        expanded = torch.tensor([5], device=DEVICE).expand(batch)
        _assert_same(backend.verify(target, draft, tokens, Sampling(temperature, 20, 0.9),
                                    Randomness(expanded, offset, False)), ref)
    # Rows not 16-byte aligned (vocab padded by 3): the scalar-load path, against the reference.
    padded = torch.zeros(batch, k + 1, vocab + 3, dtype=dtype, device=DEVICE)
    padded[..., :vocab] = target
    sliced = padded[..., :vocab]
    _assert_same(backend.verify(sliced, draft, tokens, GREEDY, Randomness(seed, offset, False)),
                 verify_reference(target, draft, tokens, GREEDY, Randomness(seed, offset, False)))
    agreement = _replay(backend, sliced, draft, tokens, REPLAY_WARPS[3], DEVICE)
    assert agreement >= MIN_AGREEMENT


@gpu
def test_mixed_dtypes(backend):
    target, draft, tokens = _inputs(3, 4, 1000, torch.float32, seed=19)
    agreement = _replay(backend, target.to(torch.bfloat16), draft, tokens, REPLAY_WARPS[1], DEVICE)
    assert agreement >= MIN_AGREEMENT


# ---- invalid rows ----------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("warp", [dict(temperature=0.0, top_k=0, top_p=1.0), REPLAY_WARPS[0], REPLAY_WARPS[3]],
                         ids=str)
@pytest.mark.parametrize("vocab", [111, 8193])
def test_invalid_rows_flagged(backend, vocab, warp):
    batch, k = 10, 3
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=23)
    target[1, 2, 5] = float("nan")
    draft[2, 0, vocab - 1] = float("inf")
    target[3, k] = float("-inf")  # the bonus position entirely -inf
    tokens[4, 1] = vocab
    tokens[5, 0] = -1
    draft[6, 1] = float("-inf")
    target[7, 0, : vocab // 2] = float("-inf")  # partly -inf: valid
    draft[8, 1, 3] = float("-inf")  # valid
    bad = torch.tensor([1, 2, 3, 4, 5, 6], device=DEVICE)
    good = torch.tensor([0, 7, 8, 9], device=DEVICE)
    seed, offset = _rows(3, batch), _rows(1, batch)
    got = backend.verify(target, draft, tokens, _sampling(warp), Randomness(seed, offset, False))
    assert (got[1][bad] == -1).all() and (got[0][bad] == -1).all()
    want = verify_reference(target, draft, tokens, _sampling(warp), Randomness(seed, offset, False))
    assert torch.equal(want[1][bad], got[1][bad])
    assert _agreeing_rows((got[0][good], got[1][good]), (want[0][good], want[1][good])).all()
    logits = target[:, 0].clone()
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    logits[3, 0] = float("inf")
    sampled = backend.sample(logits, _sampling(warp), Randomness(seed, offset, False))
    assert (sampled[1:4] == -1).all() and (sampled[[0, 4, 5]] >= 0).all()
    with pytest.raises(ValueError, match="target_logits"):
        ops.verify(target[:2], draft[:2], tokens[:2], **warp, seed=0, backend="cuda")


@gpu
def test_ops_never_synchronise_with_the_host(backend):
    """CUDA's sync debug mode raises on any host synchronisation: none in verify or sample, greedy or sampling,
    with or without the top-k/top-p cut (computed by torch ops on the device)."""
    target, draft, tokens = _inputs(4, 4, 32000, torch.bfloat16, seed=31)
    seed, offset = _rows(5, 4), _rows(2, 4)
    warps = [dict(temperature=0.0, top_k=0, top_p=1.0), *REPLAY_WARPS]
    for warp in warps:  # warm-up: the extension is loaded, allocations cached
        backend.verify(target, draft, tokens, _sampling(warp), Randomness(seed, offset, False))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for warp in warps:
            for d in (draft, None):
                backend.verify(target, d, tokens, _sampling(warp), Randomness(seed, offset, False))
            backend.sample(target[:, 0], _sampling(warp), Randomness(seed, offset, True))
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- torch.compile and CUDA graphs --------------------------------------------------------------------------------
@gpu
def test_torch_compile_fullgraph(backend):
    target, draft, tokens = _inputs(3, 4, 1000, torch.bfloat16, seed=3)
    seed, offset = _rows(5, 3), _rows(9, 3)

    def step(t, d, x, s, o):
        out, n = backend.verify(t, d, x, Sampling(0.8, 20, 0.9), Randomness(s, o, False))
        return out, n, backend.sample(t[:, 0], Sampling(0.8, 20, 0.9), Randomness(s, o, False))

    eager = step(target, draft, tokens, seed, offset)
    compiled = torch.compile(step, fullgraph=True)(target, draft, tokens, seed, offset)
    _assert_same(compiled, eager)


@gpu
@pytest.mark.parametrize("warp", [REPLAY_WARPS[0], REPLAY_WARPS[3]], ids=str)
def test_cuda_graph_capture(backend, warp):
    batch, k, vocab = 3, 4, 8193
    target, draft, tokens = _inputs(batch, k, vocab, torch.float16, seed=4)
    seed, offset = _rows(5, batch), _rows(0, batch)
    sampling = _sampling(warp)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            backend.verify(target, draft, tokens, sampling, Randomness(seed, offset, False))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.verify(target, draft, tokens, sampling, Randomness(seed, offset, False))
    for step in range(3):
        offset.fill_(step)
        target.copy_(_inputs(batch, k, vocab, torch.float16, seed=100 + step)[0])
        graph.replay()
        _assert_same(graph_out, backend.verify(target, draft, tokens, sampling, Randomness(seed, offset, False)))


PASSES_VARIABLE = "SPECULATIVE_KERNELS_VERIFY_PASSES"


@gpu
@pytest.mark.parametrize("warp", [dict(temperature=0.0, top_k=0, top_p=1.0), REPLAY_WARPS[0],
                                  dict(temperature=0.7, top_k=0, top_p=1.0)], ids=str)
def test_single_pass_kernel_matches_the_default_structure(backend, monkeypatch, warp):
    """SPECULATIVE_KERNELS_VERIFY_PASSES=single (every pass in one kernel: blocks claim work items, race blocks wait
    for their row's decision; bf16 without a cut) gives the default structure's outputs bit for bit: verify with and without draft
    logits and the sampler, B = 1, 3 and 64 at V = 128256 (B = 64: ~52 000 blocks, far more than the GPU holds at
    once, so the race blocks' waits meet blocks not yet started), eagerly and replayed from a CUDA graph (its memset
    node zeroes the counters at every replay)."""
    sampling = _sampling(warp)
    for batch in (1, 3, 64):
        target, draft, tokens = _inputs(batch, 4, 128256, torch.bfloat16, seed=batch)
        seed, offset = _rows(5, batch), _rows(0, batch)

        def outputs():
            randomness = Randomness(seed, offset, False)
            return [*backend.verify(target, draft, tokens, sampling, randomness),
                    *backend.verify(target, None, tokens, sampling, randomness),
                    backend.sample(target[:, 0], sampling, randomness)]

        monkeypatch.delenv(PASSES_VARIABLE, raising=False)
        want = outputs()
        monkeypatch.setenv(PASSES_VARIABLE, "single")
        _assert_same(outputs(), want)
        _assert_same(outputs(), want)  # (a second call: nothing left over from the first)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outputs()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = outputs()
        for step in range(2):
            offset.fill_(step)
            graph.replay()
            monkeypatch.delenv(PASSES_VARIABLE)
            _assert_same(graph_out, outputs())
            monkeypatch.setenv(PASSES_VARIABLE, "single")


@gpu
def test_seed_none_inside_cuda_graph_capture(backend):
    """seed=None inside a CUDA-graph capture gets a fresh device-drawn seed per replay."""
    assert_seed_none_is_captured("cuda", DEVICE)  # the fixture loaded the extension


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("warp", [dict(temperature=0.0, top_k=0, top_p=1.0), REPLAY_WARPS[3]], ids=str)
def test_logits_on_second_device_with_first_current(backend, warp):
    """Logits on cuda:1 while cuda:0 is current (an HF device_map model's head): the binding's device guard runs the
    kernels on cuda:1, on its current stream, with the same results as with cuda:1 current."""
    batch, k, vocab = 3, 4, 8193
    target, draft, tokens = _inputs(batch, k, vocab, torch.bfloat16, seed=29, device="cuda:1")
    seed, offset = _rows(5, batch, "cuda:1"), _rows(1, batch, "cuda:1")
    args = (target, draft, tokens, _sampling(warp), Randomness(seed, offset, False))
    with torch.cuda.device(1):
        want = backend.verify(*args)
        want_sample = backend.sample(target[:, 0], _sampling(warp), Randomness(seed, offset, False))
    with torch.cuda.device(0):
        got = backend.verify(*args)
        got_sample = backend.sample(target[:, 0], _sampling(warp), Randomness(seed, offset, False))
    torch.cuda.synchronize("cuda:1")
    assert got[0].device == torch.device("cuda:1")
    _assert_same(got, want)
    _assert_same([got_sample], [want_sample])
    _assert_invariants(*got, tokens)


# ---- without a CUDA device: loader logic and Python plumbing --------------------------------------------------------
@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_unavailable_reason_on_cpu():
    reason = cuda_ext.unavailable_reason()
    assert isinstance(reason, str) and "CUDA" in reason
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_ext.load()


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_public_ops_refuse_cuda_backend_on_cpu():
    target, draft, tokens = _inputs(2, 2, 10, torch.float32, seed=0, device="cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        ops.verify(target, draft, tokens, seed=0, backend="cuda")
    with pytest.raises(RuntimeError, match="CUDA"):
        ops.sample(target[:, 0], seed=0, backend="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_backend_module_import_raises_with_reason():
    saved = sys.modules.pop(BACKEND_MODULE, None)
    try:
        with pytest.raises(RuntimeError, match="cannot run"):
            importlib.import_module(BACKEND_MODULE)
    finally:
        if saved is not None:
            sys.modules[BACKEND_MODULE] = saved


def test_jit_sources_found():
    directory = cuda_ext.source_dir()
    assert directory is not None
    files = [Path(f).name for f in cuda_ext.source_files(directory)]
    # Every translation unit is compiled; TORCH_LIBRARY / TORCH_LIBRARY_FRAGMENT registration is order-independent.
    assert {"verify_kernels.cu", "bindings.cpp", "rollback_kernels.cu", "rollback_bindings.cpp"} <= set(files), files


@pytest.fixture
def fresh_loader(monkeypatch):
    """cuda_ext with a clean once-per-process cache, pretending a CUDA device is present."""
    monkeypatch.setattr(cuda_ext, "_device_reason", lambda: None)
    monkeypatch.setattr(cuda_ext, "_import_prebuilt", lambda: "speculative_kernels._C is not installed")
    monkeypatch.setattr(cuda_ext, "_jit_blocker", lambda: None)  # a toolkit matching torch's CUDA
    cuda_ext._load_once.cache_clear()
    yield
    cuda_ext._load_once.cache_clear()


def test_jit_build_not_attempted_with_a_mismatched_toolkit(monkeypatch, tmp_path):
    """nvcc of another CUDA major version than torch's: no JIT build; the reason names both versions."""
    from torch.utils import cpp_extension

    from helpers.cuda_toolkit import fake_cuda_home

    monkeypatch.setattr(cuda_ext, "_device_reason", lambda: None)
    monkeypatch.setattr(cuda_ext, "_import_prebuilt", lambda: "speculative_kernels._C is not installed")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", fake_cuda_home(tmp_path, "13.0"))
    builds = []
    monkeypatch.setattr(cuda_ext, "_jit_build", lambda: builds.append(1))
    cuda_ext._load_once.cache_clear()
    try:
        reason = cuda_ext.unavailable_reason()
    finally:
        cuda_ext._load_once.cache_clear()
    assert "CUDA 13.0" in reason and "12.8" in reason and "cannot be JIT-compiled" in reason, reason
    assert builds == []


def test_jit_failure_reported_and_not_retried(fresh_loader, monkeypatch):
    builds = []

    def failing_build():
        builds.append(1)
        raise RuntimeError("nvcc exploded")

    monkeypatch.setattr(cuda_ext, "_jit_build", failing_build)
    for _ in range(2):
        reason = cuda_ext.unavailable_reason()
        assert "not installed" in reason and "nvcc exploded" in reason
    with pytest.raises(RuntimeError, match="nvcc exploded"):
        cuda_ext.load()
    assert len(builds) == 1


def test_jit_build_runs_once(fresh_loader, monkeypatch):
    builds = []
    monkeypatch.setattr(cuda_ext, "_jit_build", lambda: builds.append(1))
    assert cuda_ext.unavailable_reason() is None
    cuda_ext.load()
    cuda_ext.load()
    assert len(builds) == 1


def _op_schemas() -> list[str]:
    """The schemas of every op the csrc/*.cpp files define (bindings.cpp's verify and sample, topk_bindings.cpp's
    k-th largest select, rollback_bindings.cpp's compaction)."""
    text = "".join(path.read_text() for path in sorted((ROOT / "csrc").glob("*.cpp")))
    return ["".join(re.findall(r"\"([^\"]*)\"", call)) for call in re.findall(r"m\.def\(\s*((?:\"[^\"]*\"\s*)+)\)", text)]


@pytest.fixture(scope="module")
def emulated_backend():
    """cuda_backend imported against a CPU stand-in of the ops: the schemas of bindings.cpp, an implementation that
    records its arguments and returns the reference's result (top_k/top_p taken from ``state``)."""
    if HAS_CUDA:
        pytest.skip("a CUDA device is present: the real ops are tested instead")
    calls, state = [], {}
    lib = torch.library.Library("speculative_kernels_cuda", "DEF")
    for schema in _op_schemas():
        lib.define(schema)

    def sampling(temperature, temperature_rows):
        if temperature_rows is None:
            return Sampling(temperature, state["top_k"], state["top_p"])
        return state["sampling"]  # per-row: the Sampling the test passed (the op receives only the temperatures)

    def verify_impl(target, draft, tokens, temperature, t_rows, t_src, t_idx, d_src, d_idx, seed, offset, per_row,
                    num_draft_tokens):
        calls.append(dict(temperature=temperature, temperature_rows=t_rows, target_cut=(t_src, t_idx),
                          draft_cut=(d_src, d_idx), num_draft_tokens=num_draft_tokens))
        return verify_reference(target, draft, tokens, sampling(temperature, t_rows), Randomness(seed, offset, per_row),
                                num_draft_tokens)

    def sample_impl(logits, temperature, t_rows, src, idx, seed, offset, per_row):
        calls.append(dict(temperature=temperature, temperature_rows=t_rows, cut=(src, idx)))
        return sample_reference(logits, sampling(temperature, t_rows), Randomness(seed, offset, per_row))

    def kth_largest_impl(logits, k):  # (the select's own tests: test_cuda_emulated.py, test_kth_largest_select.py)
        calls.append(dict(kth_largest=k))
        return kth_largest_index(logits, k).to(torch.int32)  # (the op's dtype: its fake in cuda_backend.py)

    lib.impl("verify", verify_impl, "CPU")
    lib.impl("sample", sample_impl, "CPU")
    lib.impl("kth_largest_index", kth_largest_impl, "CPU")
    saved = sys.modules.pop(BACKEND_MODULE, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_ext, "load", lambda: None)
        module = importlib.import_module(BACKEND_MODULE)
    yield module, calls, state
    sys.modules.pop(BACKEND_MODULE, None)
    if saved is not None:
        sys.modules[BACKEND_MODULE] = saved
    lib._destroy()


def _kernel_keep(logits, temperature, cut):
    """The kernels' keep mask from a (source, index) cut: (z_v, v) >= (z_source, index), z = x / T."""
    z = logits.to(torch.float32) / temperature
    source, index = cut
    value = z.gather(-1, source.to(torch.int64).unsqueeze(-1)).squeeze(-1)
    return torch.isfinite(apply_thresholds(z, value, index))


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (7, 0.6), (3, 0.95)])
def test_plumbing_and_cut_on_cpu(emulated_backend, top_k, top_p):
    module, calls, state = emulated_backend
    state.update(top_k=top_k, top_p=top_p)
    batch, k, vocab, temperature = 4, 3, 50, 0.8
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=1, device="cpu")
    target = target.round(decimals=1)  # ties at the cut
    seed, offset = _rows(4, batch, "cpu"), _rows(2, batch, "cpu")
    got = module.verify(target, draft, tokens, Sampling(temperature, top_k, top_p), Randomness(seed, offset, False))
    _assert_same(got, verify_reference(target, draft, tokens, Sampling(temperature, top_k, top_p),
                                       Randomness(seed, offset, False)))
    call = calls[-1]
    assert isinstance(call["temperature"], float)
    for logits, cut, shape in ((target, call["target_cut"], (batch, k + 1)), (draft, call["draft_cut"], (batch, k))):
        assert all(t.dtype == torch.int32 and tuple(t.shape) == shape for t in cut)
        want = torch.isfinite(warp_logits(logits, temperature, top_k, top_p))
        assert torch.equal(_kernel_keep(logits, temperature, cut), want)
    module.sample(target[:, 0], Sampling(temperature, top_k, top_p), Randomness(seed, offset, True))
    assert torch.equal(_kernel_keep(target[:, 0], temperature, calls[-1]["cut"]),
                       torch.isfinite(warp_logits(target[:, 0], temperature, top_k, top_p)))


def test_no_cut_passed_when_inactive(emulated_backend):
    module, calls, state = emulated_backend
    batch, k, vocab = 2, 2, 20
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=2, device="cpu")
    seed, offset = _rows(1, batch, "cpu"), _rows(0, batch, "cpu")
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, vocab, 1.0), (0.0, 5, 0.5)):
        state.update(top_k=top_k, top_p=top_p)
        module.verify(target, draft, tokens, Sampling(temperature, top_k, top_p), Randomness(seed, offset, False))
        assert calls[-1]["target_cut"] == (None, None) and calls[-1]["draft_cut"] == (None, None)


def test_fake_impls_under_torch_compile_on_cpu(emulated_backend):
    module, _, state = emulated_backend
    state.update(top_k=5, top_p=0.9)
    target, draft, tokens = _inputs(3, 2, 40, torch.float32, seed=3, device="cpu")
    seed, offset = _rows(5, 3, "cpu"), _rows(1, 3, "cpu")

    def step(t, d, x, s, o):
        out, n = module.verify(t, d, x, Sampling(0.8, 5, 0.9), Randomness(s, o, False))
        return out, n, module.sample(t[:, 0], Sampling(0.8, 5, 0.9), Randomness(s, o, False))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    _assert_same(compiled(target, draft, tokens, seed, offset), step(target, draft, tokens, seed, offset))


# ---- per-row draft limits and sampling parameters (issues 15, 16), mirroring test_triton_ops.py ---------------------
MIXED = [(0.5, 0, 1.0), (1.0, 0, 1.0), (1.5, 0, 1.0), (1.0, 3, 1.0), (0.9, 0, 0.7), (0.0, 0, 1.0)]


def _row_sampling(kinds, repeat=1, device=DEVICE) -> Sampling:
    """Sampling with per-row tensors for ``kinds`` [(temperature, top_k, top_p)], each repeated ``repeat`` times."""
    from speculative_kernels.ops.validation import check_sampling

    t, k, p = zip(*kinds)
    rep = (lambda values, dtype: torch.tensor(values, dtype=dtype).repeat_interleave(repeat).to(device))
    return check_sampling(rep(t, torch.float32), rep(k, torch.int64), rep(p, torch.float64), len(kinds) * repeat,
                          torch.device(device))


def _limit_sampling(name, batch) -> Sampling:
    if name == "greedy":
        return GREEDY
    if name == "mixed":
        return _row_sampling(MIXED * (batch // len(MIXED)) + MIXED[:batch % len(MIXED)])
    return _sampling(REPLAY_WARPS[int(name)])


@gpu
@pytest.mark.parametrize("name", ["greedy", "0", "3", "mixed"])
@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("vocab", [111, 32000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_draft_limit_replays_reference(backend, dtype, vocab, one_hot, name):
    """num_draft_tokens 0..K per row against the reference: greedy bit-exact, sampling with the same random numbers;
    n_b = K for every row is the call without it."""
    batch, k = 64, 4
    target, draft, tokens = _inputs(batch, k, vocab, dtype, seed=vocab + 3)
    tokens[:, :2] = target[:, :2].float().argmax(-1)  # accepted when greedy, so the limits matter
    limit = torch.arange(batch, device=DEVICE) % (k + 1)
    d = None if one_hot else draft
    args = (target, d, tokens, _limit_sampling(name, batch), Randomness(torch.arange(batch, device=DEVICE) + 5,
                                                                        _rows(3, batch), True))
    got = backend.verify(*args, limit)
    _assert_invariants(*got, tokens)
    assert (got[1] <= limit).all()
    want = verify_reference(*args, limit)
    if name == "greedy":
        _assert_same(got, want)
    else:
        assert _agreeing_rows(got, want).float().mean() >= MIN_AGREEMENT
    _assert_same(backend.verify(*args, _rows(k, batch)), backend.verify(*args))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_logits_per_row_and_limit_bit_exact(backend, dtype):
    """p = 1/V exactly at every temperature: with per-row temperatures (greedy rows included) and per-row limits the
    Philox numbers alone decide, so the kernels must reproduce the reference bit for bit."""
    batch, k, vocab = 60, 4, 1000
    g = torch.Generator(device=DEVICE).manual_seed(1)
    target = torch.zeros(batch, k + 1, vocab, dtype=dtype, device=DEVICE)
    tokens = torch.randint(0, vocab, (batch, k), generator=g, device=DEVICE)
    limit = torch.arange(batch, device=DEVICE) % (k + 1)
    sampling = _row_sampling([(t, 0, 1.0) for t, _, _ in MIXED], batch // len(MIXED))
    seed = torch.randint(0, 2**62, (batch,), generator=g, device=DEVICE)
    randomness = Randomness(seed, _rows(7, batch), True)
    got = backend.verify(target, None, tokens, sampling, randomness, limit)
    _assert_same(got, verify_reference(target, None, tokens, sampling, randomness, limit))
    _assert_same([backend.sample(target[:, 0], sampling, randomness)],
                 [sample_reference(target[:, 0], sampling, randomness)])


@gpu
def test_draft_limit_rows_past_it_never_read(backend):
    batch, k, vocab = 4, 3, 1000
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=42)
    limit = torch.tensor([0, 1, 2, 3], device=DEVICE)
    randomness = Randomness(_rows(5, batch), _rows(0, batch), False)
    for sampling in (GREEDY, _sampling(REPLAY_WARPS[3]), _row_sampling(MIXED[2:])):
        clean = backend.verify(target, draft, tokens, sampling, randomness, limit)
        j = torch.arange(k + 1, device=DEVICE).unsqueeze(0)
        dirty_target, dirty_draft, dirty_tokens = target.clone(), draft.clone(), tokens.clone()
        dirty_target[j > limit.unsqueeze(1)] = float("nan")
        dirty_draft[j[:, :k] >= limit.unsqueeze(1)] = float("nan")
        dirty_tokens[j[:, :k] >= limit.unsqueeze(1)] = -1
        _assert_same(backend.verify(dirty_target, dirty_draft, dirty_tokens, sampling, randomness, limit), clean)


@gpu
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_draft_limit_out_of_range_flagged(backend, temperature):
    batch, k, vocab = 4, 2, 300
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=43)
    limit = torch.tensor([1, -1, k + 1, 2], device=DEVICE)
    args = (target, draft, tokens, Sampling(temperature, 0, 1.0), Randomness(_rows(1, batch), _rows(0, batch), False))
    out, n = backend.verify(*args, limit)
    assert (n[1:3] == -1).all() and (out[1:3] == -1).all()
    want = verify_reference(*args, limit)
    assert torch.equal(n.cpu(), want[1].cpu()) and _agreeing_rows((out[[0, 3]], n[[0, 3]]),
                                                                   (want[0][[0, 3]], want[1][[0, 3]])).all()
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[0, 2\]"):
        ops.verify(target, draft, tokens, temperature=temperature, seed=1, num_draft_tokens=limit, backend="cuda")


@gpu
@pytest.mark.parametrize("vocab", [111, 32000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_row_parameters_replay_reference(backend, dtype, vocab):
    """One launch of greedy rows and rows at three temperatures, with top-k and with top-p: verify (dense and one-hot
    q) and sample against the reference with the same random numbers; greedy rows bit-exact."""
    batch, k = 22 * len(MIXED), 3
    target, draft, tokens = _inputs(batch, k, vocab, dtype, seed=vocab + 44)
    tokens[::2, 0] = target[::2, 0].float().argmax(-1)
    sampling = _row_sampling(MIXED, 22)
    randomness = Randomness(torch.arange(batch, device=DEVICE) + 9, _rows(4, batch), True)
    greedy = sampling.rows.greedy
    for d in (draft, None):
        got = backend.verify(target, d, tokens, sampling, randomness)
        _assert_invariants(*got, tokens)
        want = verify_reference(target, d, tokens, sampling, randomness)
        _assert_same((got[0][greedy], got[1][greedy]), (want[0][greedy], want[1][greedy]))
        assert _agreeing_rows(got, want).float().mean() >= MIN_AGREEMENT
    got = backend.sample(target[:, 0], sampling, randomness)
    want = sample_reference(target[:, 0], sampling, randomness)
    assert torch.equal(got[greedy].cpu(), want[greedy].cpu()) and (got == want).float().mean() >= MIN_AGREEMENT


@gpu
def test_per_row_row_alone_and_scalar_call_are_identical(backend):
    """Per-row seeds: a row of a mixed batch equals that row alone ([1] tensors) and the scalar call with its values,
    bit for bit (same backend); with a draft limit too."""
    batch, k, vocab = len(MIXED), 2, 8193
    target, draft, tokens = _inputs(batch, k, vocab, torch.bfloat16, seed=45)
    sampling = _row_sampling(MIXED)
    seed, offset = torch.arange(batch, device=DEVICE) * 13 + 1, torch.arange(batch, device=DEVICE)
    limit = torch.tensor([2, 1, 0, 2, 1, 2], device=DEVICE)
    full = backend.verify(target, draft, tokens, sampling, Randomness(seed, offset, True), limit)
    sampled = backend.sample(target[:, 0], sampling, Randomness(seed, offset, True))
    for b, kind in enumerate(MIXED):
        one = slice(b, b + 1)
        randomness = Randomness(seed[one], offset[one], False)
        for alone in (_row_sampling([kind]), Sampling(*kind)):
            got = backend.verify(target[one], draft[one], tokens[one], alone, randomness, limit[one])
            _assert_same((got[0][0], got[1][0]), (full[0][b], full[1][b]))
            assert backend.sample(target[one, 0], alone, randomness)[0] == sampled[b]


@gpu
def test_per_row_invalid_values_flagged(backend):
    batch, k, vocab = 4, 2, 300
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=46)
    bad = dict(temperature=torch.tensor([0.0, -1.0, 0.8, 0.8], device=DEVICE),
               top_k=torch.tensor([0, 0, -2, 0], device=DEVICE),
               top_p=torch.tensor([1.0, 1.0, 1.0, 0.5], device=DEVICE))
    out, n = ops.verify(target, draft, tokens, **bad, seed=2, backend="cuda", check=False)
    assert (n[1:3] == -1).all() and (out[1:3] == -1).all() and (n[[0, 3]] >= 0).all()
    with pytest.raises(ValueError, match=r"temperature must be finite and >= 0.*batch rows \[1\]"):
        ops.verify(target, draft, tokens, **bad, seed=2, backend="cuda")
    sampled = ops.sample(target[:, 0], **bad, seed=2, backend="cuda", check=False)
    assert (sampled[1:3] == -1).all() and (sampled[[0, 3]] >= 0).all()


@gpu
@pytest.mark.parametrize("one_hot", [False, True])
def test_per_row_first_token_and_sample_follow_each_rows_target(backend, one_hot):
    """One mixed batch: each row kind's first emitted token (with a draft drawn with the row's own parameters) and
    its sampled token follow that row's warped target distribution (chi-square); greedy rows emit the argmax."""
    vocab, k, rows = 10, 2, STAT_ROWS
    target, draft = _stat_logits(k + 1, vocab, 47), _stat_logits(k, vocab, 48)
    t, kk, p = (torch.tensor(v).repeat_interleave(rows).to(DEVICE) for v in zip(*MIXED))
    params = dict(temperature=t.float(), top_k=kk, top_p=p.double())
    batch = len(MIXED) * rows
    target_b, draft_b = target.expand(batch, -1, -1), draft.expand(batch, -1, -1)
    if one_hot:
        tokens = torch.randint(0, vocab, (batch, k), device=DEVICE)
    else:
        tokens = torch.stack([ops.sample(draft_b[:, i], **params, seed=5, offset=i, backend="cuda")
                              for i in range(k)], dim=1)
    out, n = ops.verify(target_b, None if one_hot else draft_b, tokens, **params, seed=5, backend="cuda")
    _assert_invariants(out, n, tokens)
    sampled = ops.sample(target_b[:, 0], **params, seed=6, backend="cuda")
    for index, warp in enumerate(MIXED):
        part = slice(index * rows, (index + 1) * rows)
        if warp[0] == 0.0:
            assert (sampled[part] == target[0].argmax()).all()
            continue
        probs = _probs(target[0], dict(zip(("temperature", "top_k", "top_p"), warp))).numpy()
        assert_matches(np.bincount(out[part, 0].cpu().numpy(), minlength=vocab), probs)
        assert_matches(np.bincount(sampled[part].cpu().numpy(), minlength=vocab), probs)


@gpu
@pytest.mark.parametrize("limit", [1, 2])
def test_limited_accept_count_and_bonus_follow_theory(backend, limit):
    """n is truncated at n_b (P(n = n_b) = prod beta) and the token after n_b acceptances follows p_{n_b}."""
    vocab, k = 8, 3
    warp = STAT_WARPS[0]
    target, draft = _stat_logits(k + 1, vocab, 49), _stat_logits(k, vocab, 50)
    target_b, draft_b = target.expand(STAT_ROWS, -1, -1), draft.expand(STAT_ROWS, -1, -1)
    tokens = torch.stack([ops.sample(draft_b[:, i], **warp, seed=1, offset=i, backend="cuda") for i in range(k)], 1)
    out, n = ops.verify(target_b, draft_b, tokens, **warp, seed=1, backend="cuda",
                        num_draft_tokens=_rows(limit, STAT_ROWS))
    out, n = out.cpu(), n.cpu()
    p, q = _probs(target, warp), _probs(draft, warp)
    beta = torch.minimum(p[:limit], q[:limit]).sum(-1).double().numpy()
    survive = np.concatenate([[1.0], np.cumprod(beta)])
    assert_matches(np.bincount(n.numpy(), minlength=limit + 1), np.append(survive[:-1] * (1 - beta), survive[-1]))
    assert_matches(np.bincount(out[n == limit, limit].numpy(), minlength=vocab), p[limit].numpy())


@gpu
def test_per_row_and_limit_capture_without_host_sync(backend):
    """Per-row temperatures/top-k/top-p and num_draft_tokens are read from device tensors at replay time, and neither
    op synchronises with the host."""
    batch, k, vocab = 6, 4, 32000
    target, draft, tokens = _inputs(batch, k, vocab, torch.bfloat16, seed=48)
    sampling = _row_sampling(MIXED)
    randomness = Randomness(_rows(7, batch), _rows(0, batch), False)
    limit = torch.tensor([4, 3, 2, 1, 0, 4], device=DEVICE)
    args = (target, draft, tokens, sampling, randomness)
    eager = backend.verify(*args, limit)
    backend.sample(target[:, 0], sampling, randomness)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.verify(*args, limit)
        backend.sample(target[:, 0], sampling, randomness)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.verify(*args, limit)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend.verify(*args, limit)
    graph.replay()
    _assert_same(captured, eager)
    limit.copy_(torch.tensor([0, 1, 2, 3, 4, 0], device=DEVICE))
    sampling.rows.temperature.copy_(torch.tensor([0.0, 0.7, 0.0, 1.2, 1.0, 0.5], device=DEVICE))
    graph.replay()
    _assert_same(captured, backend.verify(*args, limit))


@gpu
def test_per_row_and_limit_torch_compile_fullgraph(backend):
    target, draft, tokens = _inputs(6, 4, 1000, torch.bfloat16, seed=3)
    seed, offset = _rows(5, 6), _rows(9, 6)
    limit = torch.tensor([4, 3, 2, 1, 0, 4], device=DEVICE)
    params = _row_sampling(MIXED)

    def step(t, d, x, s, o, nb):
        out, n = backend.verify(t, d, x, params, Randomness(s, o, False), nb)
        return out, n, backend.sample(t[:, 0], params, Randomness(s, o, False))

    eager = step(target, draft, tokens, seed, offset, limit)
    compiled = torch.compile(step, fullgraph=True)(target, draft, tokens, seed, offset, limit)
    _assert_same(compiled, eager)


def test_per_row_plumbing_and_cut_on_cpu(emulated_backend):
    """Per-row parameters reach the op as temperature_rows (float32 [B]) and per-row cuts: each row's keep mask is its
    own warp's (none for greedy rows and rows without top-k/top-p); num_draft_tokens is passed through."""
    module, calls, state = emulated_backend
    kinds = [(0.8, 5, 1.0), (0.0, 5, 0.5), (1.0, 0, 0.8), (1.3, 7, 0.6), (0.9, 0, 1.0)]
    batch, k, vocab = len(kinds), 3, 50
    target, draft, tokens = _inputs(batch, k, vocab, torch.float32, seed=1, device="cpu")
    target = target.round(decimals=1)  # ties at the cut
    sampling = _row_sampling(kinds, device="cpu")
    state.update(sampling=sampling)
    seed, offset = _rows(4, batch, "cpu"), _rows(2, batch, "cpu")
    limit = torch.tensor([3, 0, 1, 2, 3])
    got = module.verify(target, draft, tokens, sampling, Randomness(seed, offset, False), limit)
    _assert_same(got, verify_reference(target, draft, tokens, sampling, Randomness(seed, offset, False), limit))
    call = calls[-1]
    assert call["num_draft_tokens"] is limit
    assert call["temperature_rows"].dtype == torch.float32 and torch.equal(call["temperature_rows"],
                                                                            sampling.rows.temperature)
    for logits, cut, shape in ((target, call["target_cut"], (batch, k + 1)), (draft, call["draft_cut"], (batch, k))):
        assert all(t.dtype == torch.int32 and tuple(t.shape) == shape for t in cut)
        for b, (temperature, top_k, top_p) in enumerate(kinds):
            divisor = temperature if temperature > 0 else 1.0
            keep = _kernel_keep(logits[b], divisor, (cut[0][b], cut[1][b]))
            if temperature == 0.0:
                assert keep.all()  # greedy rows: no cut
            else:
                assert torch.equal(keep, torch.isfinite(warp_logits(logits[b], temperature, top_k, top_p)))
    module.sample(target[:, 0], sampling, Randomness(seed, offset, True))
    call = calls[-1]
    for b, (temperature, top_k, top_p) in enumerate(kinds):
        keep = _kernel_keep(target[b, 0], temperature or 1.0, (call["cut"][0][b], call["cut"][1][b]))
        assert keep.all() if temperature == 0.0 else torch.equal(
            keep, torch.isfinite(warp_logits(target[b, 0], temperature, top_k, top_p)))
