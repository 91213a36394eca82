"""The reference ``ops.verify``/``ops.sample``: exactness (statistical), invariants, greedy semantics, bad input."""

import numpy as np
import pytest
import torch

from speculative_kernels import ops
from speculative_kernels.ops.warping import warp_logits
from helpers.sampling import hf_warpers
from helpers.stats import assert_matches

ROWS = 40_000
WARPS = [
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=0.7, top_k=0, top_p=1.0),
    dict(temperature=1.3, top_k=4, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=0.8),
    dict(temperature=0.9, top_k=5, top_p=0.9),
]


def _logits(k: int, vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, vocab, generator=g) * scale


def _probs(logits, warp):
    return torch.softmax(warp_logits(logits, warp["temperature"], warp["top_k"], warp["top_p"]), dim=-1)


def _draft_and_verify(target_row_logits, draft_row_logits, warp, seed=0):
    """ROWS independent verifications of the same logits; draft tokens drawn from q with ops.sample."""
    k = draft_row_logits.shape[0]
    target = target_row_logits.expand(ROWS, -1, -1)
    draft = draft_row_logits.expand(ROWS, -1, -1)
    tokens = torch.stack(
        [ops.sample(draft[:, i].contiguous(), **warp, seed=seed, offset=i, backend="torch") for i in range(k)], dim=1
    )
    out, n = ops.verify(target, draft, tokens, **warp, seed=seed, offset=0, backend="torch")
    return tokens, out, n


@pytest.mark.parametrize("warp", WARPS, ids=str)
def test_first_token_follows_target(warp):
    vocab, k = 8, 3
    target, draft = _logits(k + 1, vocab, 1), _logits(k, vocab, 2)
    _, out, _ = _draft_and_verify(target, draft, warp)
    counts = np.bincount(out[:, 0].numpy(), minlength=vocab)
    assert_matches(counts, _probs(target[0], warp).numpy())


@pytest.mark.parametrize("warp", WARPS, ids=str)
def test_accepted_count_follows_theory(warp):
    """P(n >= i) = prod_{j<i} sum_v min(p_j, q_j): positions are independent here."""
    vocab, k = 8, 4
    target, draft = _logits(k + 1, vocab, 3), _logits(k, vocab, 4)
    _, _, n = _draft_and_verify(target, draft, warp)
    p, q = _probs(target, warp), _probs(draft, warp)
    beta = torch.minimum(p[:k], q).sum(dim=-1).double().numpy()
    survive = np.concatenate([[1.0], np.cumprod(beta)])
    expected = survive[:-1] * (1 - beta)
    expected = np.append(expected, survive[-1])
    assert_matches(np.bincount(n.numpy(), minlength=k + 1), expected)


def test_emitted_token_after_rejection_is_residual():
    """Rows rejected at position 0 emit from norm(max(0, p0 - q0)) (catches a missing max(0, .) and p/q swaps)."""
    vocab, k = 6, 2
    warp = WARPS[0]
    target, draft = _logits(k + 1, vocab, 5, scale=2.0), _logits(k, vocab, 6, scale=2.0)
    _, out, n = _draft_and_verify(target, draft, warp)
    p, q = _probs(target, warp), _probs(draft, warp)
    residual = torch.clamp(p[0] - q[0], min=0)
    rejected = n == 0
    assert rejected.sum() > 1000
    assert_matches(np.bincount(out[rejected, 0].numpy(), minlength=vocab), residual.numpy())


def test_bonus_token_comes_from_last_position():
    vocab, k = 6, 2
    warp = WARPS[0]
    base = _logits(1, vocab, 7)
    target = torch.cat([base.expand(k, -1), _logits(1, vocab, 8, scale=2.5)])  # p_0 = p_1 = q: all accepted
    draft = base.expand(k, -1)
    _, out, n = _draft_and_verify(target, draft, warp)
    assert bool((n == k).all())
    assert_matches(np.bincount(out[:, k].numpy(), minlength=vocab), _probs(target[k], warp).numpy())


@pytest.mark.parametrize("warp", WARPS[:3], ids=str)
def test_one_hot_drafter_keeps_target_distribution(warp):
    vocab, k = 8, 3
    target = _logits(k + 1, vocab, 9)
    tokens = torch.tensor([[3, 1, 4]]).expand(ROWS, -1)
    out, n = ops.verify(target.expand(ROWS, -1, -1), None, tokens, **warp, seed=5, backend="torch")
    assert_matches(np.bincount(out[:, 0].numpy(), minlength=vocab), _probs(target[0], warp).numpy())
    p0 = _probs(target[0], warp)[3].item()
    accepted_first = (n >= 1).double().mean().item()
    assert abs(accepted_first - p0) < 5 * np.sqrt(p0 * (1 - p0) / ROWS) + 1e-9


def test_draft_sampler_follows_q():
    vocab = 9
    logits = _logits(1, vocab, 10)
    for warp in WARPS:
        tokens = ops.sample(logits.expand(ROWS, -1), **warp, seed=3, backend="torch")
        assert_matches(np.bincount(tokens.numpy(), minlength=vocab), _probs(logits[0], warp).numpy())


@pytest.mark.parametrize("seed", [0, 1])
def test_warping_matches_hf_warpers_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, 50, generator=g)  # continuous: no ties (HF's unstable sort orders ties arbitrarily)
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.6), (1.2, 10, 0.75), (0.5, 3, 0.3)]:
        expected = hf_warpers(temperature, top_k, top_p)(None, logits.clone())
        assert torch.equal(warp_logits(logits, temperature, top_k, top_p), expected)


def test_top_p_ties_are_cut_in_index_order():
    """Our documented tie rule (a stable sort): among equal logits at the cut, lower ids are removed first."""
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 3.0]])
    probs = torch.softmax(logits, dim=-1)
    top_p = 1.0 - (probs[0, 0] + probs[0, 1]).item() - 1e-6  # removes id 0 and the first of the tied ids
    warped = warp_logits(logits, 1.0, 0, top_p)
    assert torch.isinf(warped[0, :2]).all() and torch.isfinite(warped[0, 2:]).all()


def test_invariants():
    vocab, k, rows = 7, 4, 2000
    target = torch.randn(rows, k + 1, vocab)
    draft = torch.randn(rows, k, vocab)
    tokens = torch.randint(0, vocab, (rows, k))
    draft[torch.arange(rows), 0, tokens[:, 0]] = float("-inf")  # q(x_1) = 0: never accepted
    out, n = ops.verify(target, draft, tokens, seed=11, backend="torch")
    assert bool((n == 0).all())
    emitted = (out >= 0).sum(dim=1)
    assert torch.equal(emitted, n + 1)
    positions = torch.arange(k + 1)
    assert bool(((out >= 0) == (positions < (n + 1).unsqueeze(1))).all())  # -1 padding is contiguous
    again, n_again = ops.verify(target, draft, tokens, seed=11, backend="torch")
    assert torch.equal(out, again) and torch.equal(n, n_again)
    other, _ = ops.verify(target, draft, tokens, seed=12, backend="torch")
    assert not torch.equal(out, other)


def test_per_row_seed_is_independent_of_batch_position():
    vocab, k = 11, 3
    target, draft = torch.randn(4, k + 1, vocab), torch.randn(4, k, vocab)
    tokens = torch.randint(0, vocab, (4, k))
    seeds = torch.tensor([5, 6, 7, 8])
    out, n = ops.verify(target, draft, tokens, seed=seeds, offset=3, backend="torch")
    order = torch.tensor([2, 0, 3, 1])
    out2, n2 = ops.verify(target[order], draft[order], tokens[order], seed=seeds[order], offset=3, backend="torch")
    assert torch.equal(out2, out[order]) and torch.equal(n2, n[order])


def test_greedy_accepts_matching_prefix_and_breaks_ties_low():
    vocab = 5
    target = torch.zeros(1, 4, vocab)
    target[0, 0, 2] = 1.0
    target[0, 1, 4] = 1.0
    target[0, 2, [1, 3]] = 2.0  # tie: argmax is 1
    target[0, 3, 0] = 1.0
    out, n = ops.verify(target, torch.randn(1, 3, vocab), torch.tensor([[2, 4, 3]]), temperature=0.0, backend="torch")
    assert n.tolist() == [2] and out.tolist() == [[2, 4, 1, -1]]
    out, n = ops.verify(target, None, torch.tensor([[2, 4, 1]]), temperature=0.0, backend="torch")
    assert n.tolist() == [3] and out.tolist() == [[2, 4, 1, 0]]


def test_p_zero_token_never_accepted_even_with_r_zero():
    vocab, rows = 4, 5000
    target = torch.zeros(rows, 2, vocab)
    target[:, 0, 1] = float("-inf")  # p_0(1) = 0
    out, n = ops.verify(target, None, torch.ones(rows, 1, dtype=torch.int64), seed=1, backend="torch")
    assert bool((n == 0).all()) and bool((out[:, 0] != 1).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_raise(bad):
    target, draft = torch.randn(2, 3, 10), torch.randn(2, 2, 10)
    tokens = torch.randint(0, 10, (2, 2))
    target[1, 2, 4] = bad
    with pytest.raises(ValueError, match="target_logits.*rows \\[1\\]"):
        ops.verify(target, draft, tokens, backend="torch")
    out, n = ops.verify(target, draft, tokens, backend="torch", check=False)
    assert n.tolist()[1] == -1 and out[1].tolist() == [-1, -1, -1]
    target[1, 2, 4] = 0.0
    draft[0, 0, :] = float("-inf")
    with pytest.raises(ValueError, match="draft_logits.*rows \\[0\\]"):
        ops.verify(target, draft, tokens, temperature=0.0, backend="torch")
    with pytest.raises(ValueError, match="logits"):
        ops.sample(torch.full((1, 5), float("nan")), backend="torch")


def test_bad_arguments_name_themselves():
    target, draft = torch.randn(1, 3, 10), torch.randn(1, 2, 10)
    tokens = torch.randint(0, 10, (1, 2))
    with pytest.raises(ValueError, match="draft_tokens has ids outside"):
        ops.verify(target, draft, tokens + 10, backend="torch")
    with pytest.raises(ValueError, match="draft_tokens must have shape"):
        ops.verify(target, draft, tokens[:, :1], backend="torch")
    with pytest.raises(ValueError, match="draft_logits must have shape"):
        ops.verify(target, draft[:, :, :5], tokens, backend="torch")
    with pytest.raises(TypeError, match="target_logits must be float32"):
        ops.verify(target.double(), draft, tokens, backend="torch")
    with pytest.raises(TypeError, match="draft_tokens must be int64"):
        ops.verify(target, draft, tokens.float(), backend="torch")
    with pytest.raises(ValueError, match="temperature"):
        ops.verify(target, draft, tokens, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        ops.verify(target, draft, tokens, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        ops.verify(target, draft, tokens, top_k=-2)
    with pytest.raises(ValueError, match="backend"):
        ops.verify(target, draft, tokens, backend="tpu")
    with pytest.raises(RuntimeError, match="'cuda' cannot run"):
        ops.verify(target, draft, tokens, backend="cuda")
    with pytest.raises(ValueError, match="seed or generator"):
        ops.verify(target, draft, tokens, seed=1, generator=torch.Generator())


def test_generator_makes_runs_repeatable():
    target, draft = torch.randn(8, 3, 50), torch.randn(8, 2, 50)
    tokens = torch.randint(0, 50, (8, 2))
    a = ops.verify(target, draft, tokens, generator=torch.Generator().manual_seed(4), backend="torch")
    b = ops.verify(target, draft, tokens, generator=torch.Generator().manual_seed(4), backend="torch")
    assert torch.equal(a[0], b[0])


def test_logits_that_overflow_when_scaled_are_invalid():
    """A finite logit that overflows float32 once divided by the temperature never becomes a token (it used to give
    token 0): the row is flagged, and the checked op names the input and the temperature. Greedy is unaffected."""
    target, draft = torch.randn(2, 3, 16), torch.randn(2, 2, 16)
    tokens = torch.randint(0, 16, (2, 2))
    target[1, 1, 5] = 3e38
    for warp in (dict(), dict(top_k=4), dict(top_p=0.8)):
        out, n = ops.verify(target, draft, tokens, temperature=0.5, seed=0, backend="torch", check=False, **warp)
        assert n.tolist()[1] == -1 and out[1].tolist() == [-1, -1, -1] and n.tolist()[0] >= 0
        with pytest.raises(ValueError, match="target_logits divided by temperature=0.5 is not finite.*rows \\[1\\]"):
            ops.verify(target, draft, tokens, temperature=0.5, seed=0, backend="torch", **warp)
    assert ops.verify(target, draft, tokens, temperature=1.0, seed=0, backend="torch")[1].min() >= 0  # 3e38 / 1
    assert ops.verify(target, draft, tokens, temperature=0.0, backend="torch")[1].min() >= 0  # greedy: argmax
    draft[0, 1, 2] = -3e38  # -> -inf when scaled: fine (p = 0 there), as long as the row keeps a finite entry
    assert ops.verify(target[:1], draft[:1], tokens[:1], temperature=0.5, seed=0, backend="torch")[1].min() >= 0
    draft[0, 1] = -3e38  # every entry -> -inf: no distribution left
    with pytest.raises(ValueError, match="draft_logits divided by temperature"):
        ops.verify(target[:1], draft[:1], tokens[:1], temperature=0.5, seed=0, backend="torch")
    logits = torch.randn(2, 16)
    logits[0, 3] = 3e38
    assert ops.sample(logits, temperature=0.5, seed=0, backend="torch", check=False).tolist()[0] == -1
    with pytest.raises(ValueError, match="logits divided by temperature"):
        ops.sample(logits, temperature=0.5, seed=0, backend="torch")


def test_subnormal_temperature_is_refused():
    """temperature=1e-40 used to give token 0 everywhere; float32(1e-40) is subnormal, so it is refused by name."""
    with pytest.raises(ValueError, match="temperature=1e-40 is below float32's smallest normal"):
        ops.sample(torch.randn(2, 128), temperature=1e-40, seed=0)
    assert ops.sample(torch.randn(2, 128), temperature=1e-30, seed=0).min() >= 0  # small but normal: fine


@pytest.mark.parametrize("name,value,words", [
    ("offset", 2**32, "offset must be in \\[0, 2\\*\\*32\\), got 4294967296"),
    ("offset", -1, "offset must be in \\[0, 2\\*\\*32\\), got -1"),
    ("seed", -1, "seed must be in \\[0, 2\\*\\*63\\), got -1"),
])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_seed_and_offset_one_rule_for_ints_and_tensors(name, value, words, as_tensor):
    """An offset tensor >= 2**32 used to wrap and a seed tensor -1 was accepted, while the ints were refused."""
    given = torch.tensor(value) if as_tensor else value
    kwargs = {"seed": 0, name: given}
    with pytest.raises(ValueError, match=words):
        ops.sample(torch.randn(2, 8), backend="torch", **kwargs)
    with pytest.raises(ValueError, match=words):
        ops.verify(torch.randn(2, 2, 8), None, torch.zeros(2, 1, dtype=torch.int64), backend="torch", **kwargs)


def test_device_tensor_seeds_are_checked_with_the_result():
    """The deferred check for tensors on an accelerator (no extra host read): ``raise_for_invalid_rows`` folds the
    seed/offset range test into its one read (exercised here with CPU tensors, the code is device-agnostic)."""
    from speculative_kernels.ops.diagnostics import raise_for_invalid_rows
    from speculative_kernels.ops.randomness import Randomness

    flags, zeros = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    raise_for_invalid_rows(flags, randomness=Randomness(zeros, torch.full((3,), 2**32 - 1)))
    with pytest.raises(ValueError, match="offset must be in \\[0, 2\\*\\*32\\), got 4294967296 \\(batch rows \\[2\\]\\)"):
        raise_for_invalid_rows(flags, randomness=Randomness(zeros, torch.tensor([0, 1, 2**32])))
    with pytest.raises(ValueError, match="seed must be in \\[0, 2\\*\\*63\\), got -5"):
        raise_for_invalid_rows(flags, randomness=Randomness(torch.tensor([0, -5, 0]), zeros))


def test_empty_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="target_logits has an empty batch"):
        ops.verify(torch.randn(0, 3, 8), None, torch.zeros(0, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits has an empty batch"):
        ops.sample(torch.randn(0, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_logits_are_verified_in_full_precision(dtype):
    """Replay: bfloat16/float16 logits are verified as HF samples them, from their float32 values. Each row's
    accepted count and emitted token are recomputed in float64 from the op's own random numbers (the accept test
    r * q(x) < p(x), the race argmax w / E over the residual or p) and must agree wherever the float64 decision is
    not within float32 rounding of the other side. A probability, ratio or residual computed in half precision
    (or the temperature applied to the half values) moves p and q by about 2**-9 of themselves: 4e-4 to 8e-4 of
    total variation in one verified position of ``helpers/half_sampling_differential.py``'s models, which a
    chi-square test sees only with about 10**7 samples of it; here each of those five defects flipped 6 to 50
    of the 16000 rows' decisions."""
    from speculative_kernels.ops.philox import STREAM_POSITION
    from speculative_kernels.ops.randomness import Randomness
    from speculative_kernels.ops.reference import accept_uniforms, race_noise, verify_reference
    from speculative_kernels.ops.sampling import Sampling

    rows, k, vocab, temperature = 16000, 3, 16, 0.7
    g = torch.Generator().manual_seed(0)
    target = (torch.randn(rows, k + 1, vocab, generator=g) * 2).to(dtype)
    draft = (target[:, :k].float() + torch.randn(rows, k, vocab, generator=g)).to(dtype)
    tokens = torch.randint(0, vocab, (rows, k), generator=g)
    randomness = Randomness(torch.full((rows,), 7), torch.full((rows,), 3))
    out, n = verify_reference(target, draft, tokens, Sampling(temperature=temperature), randomness)

    # (float64 from the half values; the op's float32 division by T differs by ~1e-7, far inside the margins kept)
    p = torch.softmax(target.double() / temperature, dim=-1)
    q = torch.softmax(draft.double() / temperature, dim=-1)
    r = accept_uniforms(randomness, k).double()
    p_x, q_x = p[:, :k].gather(-1, tokens[..., None])[..., 0], q.gather(-1, tokens[..., None])[..., 0]
    margin = (r * q_x - p_x).abs() / p_x  # relative distance of each accept test from its boundary
    n64 = (r * q_x < p_x).to(torch.int64).cumprod(dim=1).sum(dim=1)
    clear = (margin > 1e-5).all(dim=1)
    assert clear.float().mean() > 0.99
    assert int((n != n64)[clear].sum()) == 0, f"{int((n != n64)[clear].sum())} accepted counts differ"

    index = torch.arange(rows)
    q_n = torch.where((n < k)[:, None], q[index, n.clamp(max=k - 1)], 0.0)
    residual = torch.clamp(p[index, n] - q_n, min=0.0)
    weights = torch.where((residual.amax(dim=-1) > 0)[:, None], residual, p[index, n])
    score = weights / race_noise(randomness, STREAM_POSITION + n, vocab).double()
    top2 = score.topk(2, dim=-1)
    clear_race = top2.values[:, 1] < top2.values[:, 0] * (1 - 1e-5)
    assert clear_race.float().mean() > 0.99
    differ = int((out[index, n] != top2.indices[:, 0])[clear_race].sum())
    assert differ == 0, f"{differ} emitted tokens differ"
