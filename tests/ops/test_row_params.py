"""Per-row draft limits (``num_draft_tokens``) and per-row sampling parameters, on the torch reference.

* semantics of num_draft_tokens, exactly: n_b = K is the call without it; n_b = 0 is one token from p at position 0
  under verify's own stream (STREAM_POSITION + 0); otherwise the row's result is the unlimited row's when that
  rejected before n_b, and else n = n_b with the bonus token raced from p at n_b (same random numbers); positions
  past n_b are never accepted (greedy drafts equal to the argmax included) and never read;
* statistics: the accepted count follows the truncated law and the token after n_b acceptances follows p_{n_b};
  per row in one mixed batch (temperatures 0.5 / 1.0 / 1.5, top-k, top-p, greedy) ``sample`` and ``verify``'s first
  token follow the row's warped target distribution (chi-square, seeded);
* per-row results never depend on the batch: a row equals the same row computed alone, and equals the scalar call
  with its values;
* validation: dtype / shape / device on entry, values flagged (-1) in the result and named with ``check``.
"""

import numpy as np
import pytest
import torch

from speculative_kernels import ops
from speculative_kernels.ops.philox import STREAM_POSITION
from speculative_kernels.ops.randomness import resolve_randomness
from speculative_kernels.ops.reference import race, race_noise
from speculative_kernels.ops.warping import warp_logits
from helpers.stats import assert_matches

ROWS = 20_000
# One batch, one row kind per entry: (temperature, top_k, top_p).
MIXED = [(0.5, 0, 1.0), (1.0, 0, 1.0), (1.5, 0, 1.0), (1.0, 3, 1.0), (0.9, 0, 0.7), (0.0, 0, 1.0)]
WARPS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9)]


def _inputs(batch, k, vocab, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g) * scale
    draft = target[:, :k] + torch.randn(batch, k, vocab, generator=g) * (0.5 * scale)
    tokens = torch.multinomial(torch.softmax(draft.reshape(-1, vocab), -1), 1, generator=g).reshape(batch, k)
    return target, draft, tokens


def _warp(warp):
    return dict(zip(("temperature", "top_k", "top_p"), warp))


def _row_params(kinds, repeat=1):
    """Per-row tensors for ``kinds`` [(temperature, top_k, top_p)], each repeated ``repeat`` times."""
    t, k, p = zip(*kinds)
    rep = (lambda values, dtype: torch.tensor(values, dtype=dtype).repeat_interleave(repeat))
    return dict(temperature=rep(t, torch.float32), top_k=rep(k, torch.int64), top_p=rep(p, torch.float64))


def _probs(logits, temperature, top_k, top_p):
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    return torch.softmax(warp_logits(logits, temperature, top_k, top_p), dim=-1).double()


# ---- num_draft_tokens: exact semantics ----------------------------------------------------------------------------
@pytest.mark.parametrize("warp", WARPS, ids=str)
@pytest.mark.parametrize("one_hot", [False, True])
def test_full_limit_is_the_unlimited_call(warp, one_hot):
    target, draft, tokens = _inputs(16, 4, 50, seed=1)
    d = None if one_hot else draft
    full = torch.full((16,), 4, dtype=torch.int64)
    want = ops.verify(target, d, tokens, **_warp(warp), seed=7, offset=3)
    got = ops.verify(target, d, tokens, **_warp(warp), seed=7, offset=3, num_draft_tokens=full)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("warp", WARPS, ids=str)
def test_zero_limit_is_one_token_from_p0(warp):
    """n_b = 0: no draft is read; the row emits one token raced from softmax(warp(target[:, 0])) with the noise of
    STREAM_POSITION + 0 at the call's seed and offset (argmax when greedy), then -1."""
    batch, k, vocab = 32, 3, 40
    target, draft, tokens = _inputs(batch, k, vocab, seed=2)
    draft[:, :] = float("nan")  # never read
    tokens[:] = -1
    zero = torch.zeros(batch, dtype=torch.int64)
    out, n = ops.verify(target, draft, tokens, **_warp(warp), seed=11, offset=5, num_draft_tokens=zero)
    assert (n == 0).all() and (out[:, 1:] == -1).all()
    temperature, top_k, top_p = warp
    if temperature == 0.0:
        want = target[:, 0].argmax(-1)
    else:
        randomness = resolve_randomness(11, 5, None, batch, target.device)
        p0 = torch.softmax(warp_logits(target[:, 0], temperature, top_k, top_p), dim=-1)
        want = race(p0, race_noise(randomness, torch.full((batch,), STREAM_POSITION), vocab))
    assert torch.equal(out[:, 0], want)


@pytest.mark.parametrize("warp", WARPS[1:], ids=str)
@pytest.mark.parametrize("one_hot", [False, True])
def test_limit_cuts_the_unlimited_result(warp, one_hot):
    """Same random numbers: a row that rejected before n_b is unchanged; a row that accepted n_b or more now stops at
    n_b and emits the race over p_{n_b} (STREAM_POSITION + n_b), not a residual."""
    batch, k, vocab = 64, 4, 30
    target, draft, tokens = _inputs(batch, k, vocab, seed=3, scale=1.0)
    d = None if one_hot else draft
    limit = torch.arange(batch) % (k + 1)
    kw = dict(**_warp(warp), seed=torch.arange(batch) + 100, offset=9)
    free_out, free_n = ops.verify(target, d, tokens, **kw)
    out, n = ops.verify(target, d, tokens, **kw, num_draft_tokens=limit)
    early = free_n < limit
    assert early.any() and (~early).any()
    assert torch.equal(out[early], free_out[early]) and torch.equal(n[early], free_n[early])
    assert torch.equal(n[~early], limit[~early])
    temperature, top_k, top_p = warp
    randomness = resolve_randomness(kw["seed"], 9, None, batch, target.device)
    p = torch.softmax(warp_logits(target, temperature, top_k, top_p), dim=-1)
    rows = torch.arange(batch)
    bonus = race(p[rows, limit], race_noise(randomness, STREAM_POSITION + limit, vocab))
    assert torch.equal(out[rows, limit][~early], bonus[~early])
    pos = torch.arange(k + 1)
    assert torch.equal(out[:, :k][pos[:k] < n.unsqueeze(1)], tokens[pos[:k] < n.unsqueeze(1)])
    assert (out[pos > n.unsqueeze(1)] == -1).all()


def test_greedy_never_accepts_past_the_limit():
    """Every draft is the argmax (all would be accepted): row b accepts exactly n_b and emits argmax z_{n_b}."""
    batch, k, vocab = 10, 4, 25
    target, _, _ = _inputs(batch, k, vocab, seed=4)
    best = target.argmax(-1)
    limit = torch.tensor([0, 1, 2, 3, 4, 4, 3, 2, 1, 0])
    for d in (None, target[:, :k].clone()):
        out, n = ops.verify(target, d, best[:, :k], temperature=0.0, num_draft_tokens=limit)
        assert torch.equal(n, limit)
        assert torch.equal(out.gather(1, limit.unsqueeze(1)).squeeze(1), best.gather(1, limit.unsqueeze(1)).squeeze(1))


def test_sampling_never_accepts_past_the_limit():
    """p = q (the draft is the target): every draft is accepted, so n == n_b exactly, over many seeds."""
    batch, k, vocab = 200, 4, 20
    target, _, _ = _inputs(batch, k, vocab, seed=5)
    draft = target[:, :k].clone()
    limit = torch.arange(batch) % (k + 1)
    for seed in range(5):
        tokens = torch.stack([ops.sample(draft[:, i], seed=seed, offset=i) for i in range(k)], dim=1)
        _, n = ops.verify(target, draft, tokens, seed=seed, num_draft_tokens=limit)
        assert torch.equal(n, limit)


@pytest.mark.parametrize("warp", WARPS, ids=str)
def test_positions_past_the_limit_are_never_read(warp):
    """NaN logits and -1 / out-of-range draft tokens past n_b change nothing and flag nothing."""
    batch, k, vocab = 12, 4, 30
    target, draft, tokens = _inputs(batch, k, vocab, seed=6)
    limit = torch.arange(batch) % (k + 1)
    clean = ops.verify(target, draft, tokens, **_warp(warp), seed=2, num_draft_tokens=limit)
    j = torch.arange(k + 1).unsqueeze(0)
    target[j > limit.unsqueeze(1)] = float("nan")
    draft[j[:, :k] >= limit.unsqueeze(1)] = float("nan")
    tokens[j[:, :k] >= limit.unsqueeze(1)] = -1
    for d in (draft, None):
        got = ops.verify(target, d, tokens, **_warp(warp), seed=2, num_draft_tokens=limit)
        assert (got[1] >= 0).all()
        if d is draft:
            assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])


def test_limit_validation():
    target, draft, tokens = _inputs(3, 2, 10, seed=7)
    with pytest.raises(TypeError, match="num_draft_tokens"):
        ops.verify(target, draft, tokens, num_draft_tokens=torch.tensor([1, 2, 0], dtype=torch.int32))
    with pytest.raises(TypeError, match="num_draft_tokens"):
        ops.verify(target, draft, tokens, num_draft_tokens=[1, 2, 0])
    with pytest.raises(ValueError, match=r"num_draft_tokens tensor must have shape \[3\]"):
        ops.verify(target, draft, tokens, num_draft_tokens=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="num_draft_tokens is on meta"):
        ops.verify(target, draft, tokens, num_draft_tokens=torch.zeros(3, dtype=torch.int64, device="meta"))
    for bad in (-1, 3):
        limit = torch.tensor([1, bad, 0])
        with pytest.raises(ValueError, match=rf"num_draft_tokens must be in \[0, 2\].*got {bad} \(batch rows \[1\]\)"):
            ops.verify(target, draft, tokens, seed=0, num_draft_tokens=limit)
        out, n = ops.verify(target, draft, tokens, seed=0, num_draft_tokens=limit, check=False)
        assert n[1] == -1 and (out[1] == -1).all() and (n[[0, 2]] >= 0).all()


def test_limit_errors_name_the_used_positions_only():
    """With check on, a NaN at a used position is named; the same NaN past the limit is not an error."""
    target, draft, tokens = _inputs(2, 3, 10, seed=8)
    target[0, 2, 1] = float("nan")
    ops.verify(target, draft, tokens, seed=0, num_draft_tokens=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"target_logits has NaN.*batch rows \[0\]"):
        ops.verify(target, draft, tokens, seed=0, num_draft_tokens=torch.tensor([2, 3]))


# ---- num_draft_tokens: statistics -------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [1, 2])
def test_limited_accept_count_and_bonus_follow_theory(limit):
    """n follows P(n = i) = prod_{j<i} beta_j (1 - beta_i) for i < n_b and prod_{j<n_b} beta_j at n_b; after n_b
    acceptances the next token follows p_{n_b} (a residual there, or an off-by-one in the limit, fails this)."""
    vocab, k = 8, 3
    g = torch.Generator().manual_seed(limit)
    target, draft = torch.randn(k + 1, vocab, generator=g) * 1.5, torch.randn(k, vocab, generator=g) * 1.5
    target_b, draft_b = target.expand(ROWS, -1, -1), draft.expand(ROWS, -1, -1)
    tokens = torch.stack([ops.sample(draft_b[:, i].contiguous(), seed=1, offset=i) for i in range(k)], dim=1)
    out, n = ops.verify(target_b, draft_b, tokens, seed=1, num_draft_tokens=torch.full((ROWS,), limit))
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    beta = torch.minimum(p[:limit], q[:limit]).sum(-1).double().numpy()
    survive = np.concatenate([[1.0], np.cumprod(beta)])
    assert_matches(np.bincount(n.numpy(), minlength=limit + 1), np.append(survive[:-1] * (1 - beta), survive[-1]))
    full = n == limit
    assert_matches(np.bincount(out[full, limit].numpy(), minlength=vocab), p[limit].numpy())


# ---- per-row sampling parameters ----------------------------------------------------------------------------------
def test_sample_follows_each_rows_warped_distribution():
    vocab = 12
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 2
    params = _row_params(MIXED, ROWS)
    tokens = ops.sample(logits.expand(len(MIXED) * ROWS, -1), **params, seed=3)
    for index, kind in enumerate(MIXED):
        got = tokens[index * ROWS:(index + 1) * ROWS]
        want = _probs(logits[0], *kind)
        if kind[0] == 0.0:
            assert (got == logits[0].argmax()).all()
        else:
            assert_matches(np.bincount(got.numpy(), minlength=vocab), want.numpy())


@pytest.mark.parametrize("one_hot", [False, True])
def test_verify_first_token_follows_each_rows_warped_target(one_hot):
    """Drafts drawn with each row's own parameters (q as the op recomputes it); the first emitted token follows the
    row's warped p_0 whatever was drafted; a greedy row emits argmax z_0."""
    vocab, k = 10, 2
    g = torch.Generator().manual_seed(10)
    target, draft = torch.randn(k + 1, vocab, generator=g) * 1.5, torch.randn(k, vocab, generator=g) * 1.5
    rows = len(MIXED) * ROWS
    params = _row_params(MIXED, ROWS)
    target_b, draft_b = target.expand(rows, -1, -1), draft.expand(rows, -1, -1)
    if one_hot:
        tokens = torch.randint(0, vocab, (rows, k), generator=g)
    else:
        tokens = torch.stack([ops.sample(draft_b[:, i].contiguous(), **params, seed=4, offset=i) for i in range(k)], 1)
    out, n = ops.verify(target_b, None if one_hot else draft_b, tokens, **params, seed=4)
    assert ((n >= 0) & (n <= k)).all()
    for index, kind in enumerate(MIXED):
        first = out[index * ROWS:(index + 1) * ROWS, 0]
        if kind[0] == 0.0:
            greedy = ops.verify(target.unsqueeze(0), None, tokens[index * ROWS:index * ROWS + 1], temperature=0.0)
            assert (first == greedy[0][0, 0]).all()
        else:
            assert_matches(np.bincount(first.numpy(), minlength=vocab), _probs(target[0], *kind).numpy())


@pytest.mark.parametrize("limit", [None, "mixed"])
def test_a_row_is_the_same_alone_and_as_scalars(limit):
    """Per-row seeds: row b of a mixed batch equals row b computed alone with its [1] tensors, and the scalar call
    with its values (float64 top_p: the threshold 1 - top_p rounds like the scalar's)."""
    batch, k, vocab = len(MIXED), 3, 40
    target, draft, tokens = _inputs(batch, k, vocab, seed=11)
    params = _row_params(MIXED)
    seed, offset = torch.arange(batch) * 31 + 7, torch.arange(batch) + 2
    limits = None if limit is None else torch.arange(batch) % (k + 1)
    for d in (draft, None):
        out, n = ops.verify(target, d, tokens, **params, seed=seed, offset=offset, num_draft_tokens=limits)
        sampled = ops.sample(target[:, 0], **params, seed=seed, offset=offset)
        for b, kind in enumerate(MIXED):
            one = slice(b, b + 1)
            alone_limit = None if limits is None else limits[one]
            db = None if d is None else d[one]
            for kw in ({key: value[one] for key, value in params.items()}, _warp(kind)):
                got = ops.verify(target[one], db, tokens[one], **kw, seed=seed[one], offset=offset[one],
                                 num_draft_tokens=alone_limit)
                assert torch.equal(got[0][0], out[b]) and got[1][0] == n[b], (b, kind, kw)
                assert ops.sample(target[one, 0], **kw, seed=seed[one], offset=offset[one])[0] == sampled[b]


def test_scalars_and_tensors_mix():
    """temperature per row with scalar top_k/top_p (and the reverse) equals full per-row tensors."""
    batch, k, vocab = 4, 2, 30
    target, draft, tokens = _inputs(batch, k, vocab, seed=12)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])
    full = dict(temperature=temperature, top_k=torch.full((batch,), 5), top_p=torch.full((batch,), 0.9,
                                                                                          dtype=torch.float64))
    want = ops.verify(target, draft, tokens, **full, seed=3)
    got = ops.verify(target, draft, tokens, temperature=temperature, top_k=5, top_p=0.9, seed=3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    seed = torch.tensor([3, 4, 5, 6])
    want = ops.verify(target, draft, tokens, temperature=0.8, top_k=torch.tensor([0, 3, 0, 7]), seed=seed)
    for b, top_k in enumerate([0, 3, 0, 7]):
        alone = ops.verify(target[b:b + 1], draft[b:b + 1], tokens[b:b + 1], temperature=0.8, top_k=top_k,
                           seed=seed[b:b + 1])
        assert torch.equal(alone[0][0], want[0][b]) and alone[1][0] == want[1][b]


@pytest.mark.parametrize("name,value,match", [
    ("temperature", torch.tensor([1.0, -0.5, 1.0]), "temperature must be finite and >= 0"),
    ("temperature", torch.tensor([1.0, float("nan"), 1.0]), "temperature must be finite and >= 0"),
    ("temperature", torch.tensor([1.0, float("inf"), 1.0]), "temperature must be finite and >= 0"),
    ("temperature", torch.tensor([1.0, 1e-39, 1.0]), "temperature is below float32's smallest normal"),
    ("top_k", torch.tensor([0, -1, 0]), "top_k must be >= 0"),
    ("top_p", torch.tensor([1.0, 0.0, 1.0]), r"top_p must be in \(0, 1\]"),
    ("top_p", torch.tensor([1.0, 1.5, 1.0]), r"top_p must be in \(0, 1\]"),
    ("top_p", torch.tensor([1.0, float("nan"), 1.0]), r"top_p must be in \(0, 1\]"),
])
def test_per_row_values_flagged_and_named(name, value, match):
    target, draft, tokens = _inputs(3, 2, 10, seed=13)
    with pytest.raises(ValueError, match=match + r".*\(batch rows \[1\]\)"):
        ops.verify(target, draft, tokens, seed=0, **{name: value})
    with pytest.raises(ValueError, match=match):
        ops.sample(target[:, 0], seed=0, **{name: value})
    out, n = ops.verify(target, draft, tokens, seed=0, check=False, **{name: value})
    assert n[1] == -1 and (out[1] == -1).all() and (n[[0, 2]] >= 0).all()
    sampled = ops.sample(target[:, 0], seed=0, check=False, **{name: value})
    assert sampled[1] == -1 and (sampled[[0, 2]] >= 0).all()


@pytest.mark.parametrize("name,value,error,match", [
    ("temperature", torch.tensor([1, 1, 1]), TypeError, "temperature tensor must be float32 or float64"),
    ("top_k", torch.tensor([1.0, 1.0, 1.0]), TypeError, "top_k tensor must be int64 or int32"),
    ("top_p", torch.tensor([1, 1, 1]), TypeError, "top_p tensor must be float32 or float64"),
    ("temperature", torch.ones(2), ValueError, r"temperature tensor must have shape \[3\]"),
    ("top_p", torch.ones(1, 3), ValueError, r"top_p tensor must have shape \[3\]"),
    ("top_k", torch.zeros(3, dtype=torch.int64, device="meta"), ValueError, "top_k is on meta"),
])
def test_per_row_tensors_checked_on_entry(name, value, error, match):
    target, draft, tokens = _inputs(3, 2, 10, seed=14)
    with pytest.raises(error, match=match):
        ops.verify(target, draft, tokens, seed=0, **{name: value})
    with pytest.raises(error, match=match):
        ops.sample(target[:, 0], seed=0, **{name: value})


def test_scaled_overflow_named_with_per_row_temperature():
    target, draft, tokens = _inputs(2, 2, 10, seed=15)
    target[1, 0, 3] = 3e38
    temperature = torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match=r"target_logits divided by its row's temperature.*batch rows \[1\]"):
        ops.verify(target, draft, tokens, temperature=temperature, seed=0)
    ops.verify(target, draft, tokens, temperature=torch.tensor([0.5, 0.0]), seed=0)  # greedy: 3e38 is finite


def test_device_named_without_index_is_the_current_one(monkeypatch):
    """``"cuda"`` names the current CUDA device: a per-row tensor made there (``cuda:N``) is on the logits' device.
    (Seen on the GPU: every per-row call from code naming ``device="cuda"`` was refused as "on cuda:0 but the logits
    are on cuda".)"""
    from speculative_kernels.ops.validation import indexed_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert indexed_device("cuda") == torch.device("cuda", 1)
    assert indexed_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert indexed_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA divides by a host scalar differently)")
def test_the_scalar_temperature_divides_as_the_per_row_one_on_cuda():
    """On CUDA, tensor / python_float is computed as a multiplication by the reciprocal (an ulp off true division on
    many inputs), while per-row temperatures and the kernels divide truly: the scalar path (the torch reference's
    warping) divides by a device scalar, so both paths round alike, as IEEE division does on the CPU (found by a
    review of the custom ops; emulated on the CPU, to be confirmed on a GPU)."""
    from speculative_kernels.ops.warping import scale_logits

    z = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)) * 8
    for temperature in (0.7, 1.3, 0.3):
        on_cuda = scale_logits(z.cuda(), temperature).cpu()
        assert torch.equal(on_cuda, scale_logits(z, temperature))
        assert torch.equal(on_cuda, (z.cuda() / torch.full((64, 1), temperature, device="cuda")).cpu())


def test_a_scalar_top_p_still_cuts_beside_a_per_row_temperature():
    """temperature per row (a tensor) makes every parameter per row: the scalar top_p=0.5 must become each row's
    cut (dropped, 30% of draws fell outside the nucleus and every test passed)."""
    from speculative_kernels import ops

    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0, 0.0, 0.0]]).repeat(2000, 1)  # the nucleus of 0.5 is token 0 alone
    tokens = ops.sample(logits, temperature=torch.ones(2000), top_p=0.5, seed=0)
    assert bool((tokens.flatten() == 0).all())


def test_scale_logits_divides_as_hfs_temperature_warper_bit_for_bit():
    from transformers.generation.logits_process import TemperatureLogitsWarper

    from speculative_kernels.ops.warping import scale_logits

    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 7
    for temperature in (0.7, 0.3, 1.3, 0.9, 3.0):
        assert torch.equal(scale_logits(logits, temperature), TemperatureLogitsWarper(temperature)(None, logits.clone()))


def test_per_row_top_k_with_top_p_sorts_each_row_once():
    """The per-row cut reads each row's k-th largest value from the ascending stable sort that top-p uses: one sort
    (it sorted every row twice). The scalar cut keeps its top-k pass: sorting the masked z, mostly -inf, is cheaper
    than sorting z. Their values are tested against HF's above and in test_sampling_boundaries.py."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from speculative_kernels.ops.warping import row_thresholds

    class Sorts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("sort", "topk"):
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    z = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0))
    with Sorts() as sorts:
        row_thresholds(z, torch.tensor([[5], [0]]), torch.tensor([[0.9], [0.5]], dtype=torch.float64))
    assert sorts.names == ["sort"]


# ---- top_k_bound: a host bound of the rows' top_k (one topk of it instead of a V-length sort per row) --------------
# (temperature, top_k, top_p) per row: greedy, top-k alone, top-k then top-p, no cut, greedy with a top_k past any bound
BOUNDED = [(0.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 12, 0.8), (1.3, 0, 1.0), (0.9, 1, 0.5), (1.0, 12, 1e-9),
           (0.0, 90, 0.3)]


def _sorts_over(vocab):
    """A dispatch mode recording the last-dimension sizes of the sorts it sees (``.sizes``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sorts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "sort":
                self.sizes.append(args[0].shape[-1])
            return func(*args, **(kwargs or {}))

    return Sorts()


@pytest.mark.parametrize("bound", [12, 13, 1000])
def test_top_k_bound_gives_the_unbounded_result_bit_for_bit(bound):
    """A bound (the rows' largest top_k, more, or past the vocabulary) changes no token: verify and sample on mixed
    rows, against the same call without it (a V-length sort per row)."""
    target, draft, tokens = _inputs(len(BOUNDED), 3, 64, seed=41)
    rows = _row_params(BOUNDED)
    for seed in range(3):
        want = ops.verify(target, draft, tokens, **rows, seed=seed)
        got = ops.verify(target, draft, tokens, **rows, seed=seed, top_k_bound=bound)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(ops.sample(target[:, 0], **rows, seed=seed, top_k_bound=bound),
                           ops.sample(target[:, 0], **rows, seed=seed))


def test_top_k_bound_replaces_the_vocabulary_sort():
    """With a bound below V the cut sorts only the bound's candidates; a python top_k beside per-row tensors is such
    a bound by itself (it sorted V per row, as per-row top_k tensors without a bound still do)."""
    vocab = 64
    target, draft, tokens = _inputs(len(BOUNDED), 3, vocab, seed=42)
    rows = _row_params(BOUNDED)
    with _sorts_over(vocab) as unbounded:
        ops.sample(target[:, 0], **rows, seed=0)
    assert vocab in unbounded.sizes
    with _sorts_over(vocab) as bounded:
        ops.verify(target, draft, tokens, **rows, seed=0, top_k_bound=12)
        ops.sample(target[:, 0], **rows, seed=0, top_k_bound=12)
    assert bounded.sizes and vocab not in bounded.sizes
    scalar_k = dict(rows, top_k=7)
    with _sorts_over(vocab) as scalar:
        got = ops.sample(target[:, 0], **scalar_k, seed=3)
    assert scalar.sizes and vocab not in scalar.sizes
    assert torch.equal(got, ops.sample(target[:, 0], **dict(rows, top_k=torch.full((len(BOUNDED),), 7)), seed=3))


def test_rows_breaking_the_top_k_bound_are_flagged_and_named():
    """A sampled row with top_k above the bound, or with top-p and no top_k, comes back invalid (-1; the checked
    call names top_k_bound and the rows), never with another cut; the other rows are unchanged, and greedy rows
    are never flagged (a cut cannot change an argmax)."""
    target, draft, tokens = _inputs(len(BOUNDED), 3, 64, seed=43)
    rows = _row_params(BOUNDED)
    rows["top_k"][3], rows["top_p"][3] = 0, 0.9  # top-p without a top_k
    want = ops.verify(target, draft, tokens, **rows, seed=1, check=False)
    got = ops.verify(target, draft, tokens, **rows, seed=1, top_k_bound=5, check=False)
    broken = [2, 3, 5]  # top_k 12 > 5; top-p without top_k; (rows 0 and 6 are greedy, row 4 has top_k 1)
    assert got[1].tolist() == [-1 if b in broken else n for b, n in enumerate(want[1].tolist())]
    assert bool((got[0][broken] == -1).all())
    keep = [b for b in range(len(BOUNDED)) if b not in broken]
    assert torch.equal(got[0][keep], want[0][keep])
    with pytest.raises(ValueError, match=r"top_k_bound=5 does not bound .* row 2 has top_k=12 .*batch rows \[2, 3, 5\]"):
        ops.verify(target, draft, tokens, **rows, seed=1, top_k_bound=5)
    sampled = ops.sample(target[:, 0], **rows, seed=1, top_k_bound=5, check=False)
    assert [b for b, t in enumerate(sampled.tolist()) if t == -1] == broken
    with pytest.raises(ValueError, match="top_k_bound=5 does not bound"):
        ops.sample(target[:, 0], **rows, seed=1, top_k_bound=5)


@pytest.mark.parametrize("value,error,match", [
    (0, ValueError, "top_k_bound must be >= 1, got 0"),
    (True, TypeError, "top_k_bound must be an int"),
    (4.0, TypeError, "top_k_bound must be an int"),
    (torch.tensor(4), TypeError, "top_k_bound must be an int"),
])
def test_top_k_bound_argument_checked(value, error, match):
    logits = torch.randn(2, 10)
    with pytest.raises(error, match=match):
        ops.sample(logits, top_k=3, top_k_bound=value, seed=0)


def test_top_k_bound_with_scalars_checked_at_once():
    """Scalar parameters are host values: a bound they break is refused before anything runs; greedy is never
    cut, so any bound holds there."""
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="top_k_bound=2 does not bound top_k=3"):
        ops.sample(logits, top_k=3, top_k_bound=2, seed=0)
    with pytest.raises(ValueError, match="top_k_bound=4 does not bound top_k=0 with top_p=0.9"):
        ops.sample(logits, top_p=0.9, top_k_bound=4, seed=0)
    assert torch.equal(ops.sample(logits, top_k=3, top_k_bound=3, seed=0), ops.sample(logits, top_k=3, seed=0))
    assert torch.equal(ops.sample(logits, temperature=0.0, top_k=30, top_k_bound=2), logits.argmax(-1))


def test_a_top_k_bound_past_int64_bounds_every_row():
    """Any python int >= 1 is a valid bound, and one of V or more bounds every row: 2**63 and 2**64 - 1 used to flag
    every sampled row (torch compares the int64 top_k with them as with a negative int64) and the checked call
    blamed top_k_bound; 10**30 raised torch's OverflowError. A python top_k past int64 beside per-row tensors is such
    a bound too: a row invalid for another reason (NaN logits) was named as breaking it, or an OverflowError."""
    target, draft, tokens = _inputs(len(BOUNDED), 3, 64, seed=44)
    rows = _row_params(BOUNDED)
    want = ops.verify(target, draft, tokens, **rows, seed=2)
    want_sample = ops.sample(target[:, 0], **rows, seed=2)
    for bound in (2**63 - 1, 2**63, 2**64 - 1, 10**30):
        got = ops.verify(target, draft, tokens, **rows, seed=2, top_k_bound=bound)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), bound
        assert torch.equal(ops.sample(target[:, 0], **rows, seed=2, top_k_bound=bound), want_sample), bound
    logits = target[:, 0].clone()
    logits[1, 3] = float("nan")
    for top_k in (0, 2**63, 10**30):  # (0: no bound; a python top_k of 0 is none)
        with pytest.raises(ValueError, match=r"logits has NaN.* batch rows \[1\]"):
            ops.sample(logits, temperature=rows["temperature"], top_k=top_k, top_p=rows["top_p"], seed=0)


def test_a_python_top_k_above_the_given_bound_breaks_it():
    """A given bound is the promise, also beside a python top_k: top_k=7 with top_k_bound=5 flags every sampled row
    (greedy rows keep their argmax), as the scalar call refuses it; the python top_k is the bound only when none is
    given."""
    target, draft, tokens = _inputs(len(BOUNDED), 3, 64, seed=45)
    temperature = _row_params(BOUNDED)["temperature"]
    sampled = [b for b, (t, _, _) in enumerate(BOUNDED) if t > 0]
    got = ops.sample(target[:, 0], temperature=temperature, top_k=7, top_k_bound=5, seed=0, check=False)
    assert [b for b, token in enumerate(got.tolist()) if token == -1] == sampled
    greedy = [b for b in range(len(BOUNDED)) if b not in sampled]
    assert torch.equal(got[greedy], target[greedy, 0].argmax(-1))
    with pytest.raises(ValueError, match=r"top_k_bound=5 does not bound .* row 1 has top_k=7"):
        ops.verify(target, draft, tokens, temperature=temperature, top_k=7, top_k_bound=5, seed=0)


def test_a_bound_beside_no_cut_or_a_vocabulary_wide_top_k_changes_nothing():
    """Scalars without a cut (top_k 0, top_p 1) keep every bound; a bound of exactly V is no bound (no topk of V
    replaces the sort): a row with top_k = V (no top-k) and top-p keeps its top-p cut, here 1e-9, the argmax (int32
    top_k tensors alike)."""
    logits = _inputs(8, 1, 16, seed=46)[0][:, 0]
    for top_k in (None, 0):
        assert torch.equal(ops.sample(logits, temperature=0.7, top_k=top_k, top_p=1.0, top_k_bound=3, seed=4),
                           ops.sample(logits, temperature=0.7, seed=4))
    rows = _row_params([(1.0, 16, 1e-9)], repeat=8)
    assert torch.equal(ops.sample(logits, **rows, top_k_bound=16, seed=4), logits.argmax(-1))
    rows = _row_params([(1.0, 16, 0.6), (0.8, 3, 0.9), (1.2, 0, 1.0), (0.0, 40, 0.3)], repeat=2)
    for seed in range(3):
        want = ops.sample(logits, **rows, seed=seed)
        assert torch.equal(ops.sample(logits, **rows, top_k_bound=16, seed=seed), want)
        assert torch.equal(ops.sample(logits, **dict(rows, top_k=rows["top_k"].int()), top_k_bound=16, seed=seed), want)


def test_a_bound_on_the_triton_backend():
    """The Triton backend (the interpreter on the CPU, the compiled kernels on a GPU) with a bound of V (no topk: the
    sort), with its rows broken, and with a python top_k past int64 beside per-row tensors (the registered ops' int64
    bound): the torch backend's tokens. (The seventh GPU run found it building its inputs on the CPU there.)"""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = _inputs(8, 1, 16, seed=47)[0][:, 0].to(device)
    rows = _row_params([(1.0, 16, 1e-9), (0.8, 20, 0.9)], repeat=4)  # (top-p keeping the argmax; broken: top_k > V)
    rows["temperature"][7] = 0.0  # (greedy: never broken)
    rows = {name: values.to(device) for name, values in rows.items()}
    calls = [dict(rows, top_k_bound=16), dict(temperature=rows["temperature"], top_k=2**63)]
    argmax = logits.argmax(-1).tolist()
    for kwargs, want in zip(calls, [argmax[:4] + [-1] * 3 + argmax[7:], None]):
        torch_tokens = ops.sample(logits, **kwargs, seed=5, check=False, backend="torch")
        assert want is None or torch_tokens.tolist() == want
        assert torch.equal(ops.sample(logits, **kwargs, seed=5, check=False, backend="triton"), torch_tokens)
