"""Kernel edge cases that the sampling replay (which tolerates 1% of rows differing) would let through.

A kernel bug confined to a small region of the vocabulary (a chunk boundary, the last partial 16-byte vector of a
row, the last id) changes few random rows. Here the result is forced into that region and checked exactly:

* planted winners: a dominant logit (40 above N(0, 2) noise) at the ids where such bugs hide (first and last ids, the
  CUDA chunk edges 2048 i, the Triton tile edges, the last partial vector), one row per id. Greedy must return it, and
  so must every race: sampling from p (``sample``; the bonus position after all drafts were accepted) and the residual
  max(0, p - q) after a rejection, with dense and with one-hot q. Checked against the planted id and bit for bit
  against the reference; no decision is near a tie, so float rounding cannot excuse a difference;
* exact-arithmetic replay: logits in {0, -inf} make p and q exact uniform distributions over random supports (and put
  massive ties at the top-k/top-p cuts), so the reference's and the kernels' arithmetic agree bit for bit and the
  replay must be ``torch.equal``: dense-q residuals after rejections, and the bonus token of rows where every draft
  is accepted (p = q bitwise before position K);
* sizes: V = 1, 2, a multiple of 2048, 256000; B = 256; rows of 1001 ids in a 1008-wide buffer (the CUDA vector
  path with a partial tail) and in a contiguous 1001-wide buffer (misaligned rows: the scalar path).

GPU: the CUDA and Triton backends at full size, every dtype. CPU (CI): the Triton interpreter at small sizes (with
its default tiling and with small split tiles) and the torch reference, so the same checks run cheaply.
"""

import functools
import importlib
import os

import pytest
import torch

from speculative_kernels.ops.randomness import Randomness
from speculative_kernels.ops.reference import sample_reference, verify_reference
from speculative_kernels.ops.sampling import GREEDY, Sampling
from speculative_kernels.ops.warping import warp_logits

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WINNER = 40.0
gpu = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device (the CPU runs the small cases below)")
cpu_only = pytest.mark.skipif(ON_CUDA, reason="the small CPU cases; a GPU runs the full-size ones")


SPLIT = dict(block_v=32, race_block_v=32, programs_per_sm=8, num_sms=2)  # small tiles, several chunks per row


def _tuning(name: str):
    from speculative_kernels.ops import triton_backend

    if name == "triton-split":
        return triton_backend.Tuning(**SPLIT)
    return triton_backend.default_tuning(torch.device(DEVICE))


@functools.cache
def _backend(name: str):
    """(verify, sample) with the reference's contract: "cuda", "cuda-fused" / "cuda-split" (the CUDA kernels' fused /
    split sampling passes at every batch size; "cuda" picks by batch size), "triton", "triton-split" (small tiles, many chunks), "torch" (the reference itself: the planted-id checks
    still test it against the definition)."""
    if name == "torch":
        return verify_reference, sample_reference
    if name.startswith("triton"):
        from speculative_kernels.ops import triton_backend

        tuning = _tuning(name)
        return (functools.partial(triton_backend.launch_verify, tuning=tuning),
                functools.partial(triton_backend.launch_sample, tuning=tuning))
    module = importlib.import_module("speculative_kernels.ops.cuda_backend")  # loads or JIT-builds the extension
    if name in ("cuda-fused", "cuda-split"):
        passes = name.removeprefix("cuda-")
        return with_verify_passes(passes, module.verify), with_verify_passes(passes, module.sample)
    return module.verify, module.sample


def with_verify_passes(passes: str, function):
    """``function`` run with SPECULATIVE_KERNELS_VERIFY_PASSES=passes ("split" / "fused": which pass structure the
    CUDA kernels launch, read at each launch)."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        previous = os.environ.get(PASSES_VARIABLE)
        os.environ[PASSES_VARIABLE] = passes
        try:
            return function(*args, **kwargs)
        finally:
            if previous is None:
                del os.environ[PASSES_VARIABLE]
            else:
                os.environ[PASSES_VARIABLE] = previous
    return run


PASSES_VARIABLE = "SPECULATIVE_KERNELS_VERIFY_PASSES"


def _chunk_widths(name: str, batch: int, k: int, vocab: int) -> set[int]:
    """The widths whose multiples are tile or chunk boundaries in backend ``name`` at this size: Triton's tiles and
    chunk sizes of both passes (from its plan, for verify with K drafts and for the sampler), CUDA's 2048-id chunk
    and its fused sampling pass's 512-id race chunk."""
    if name.startswith("triton"):
        from speculative_kernels.ops import triton_backend

        plans = [triton_backend.make_plan(batch, positions, vocab, _tuning(name)) for positions in (k + 1, 1)]
        return {w for plan in plans for w in (plan.block_v, plan.chunk_size, plan.race_block_v, plan.race_chunk_size)}
    return {512, 2048} if name in ("cuda", "cuda-fused", "cuda-split") else {32, 512, 1024, 2048}


def _rows(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64, device=DEVICE)


def _randomness(batch: int, salt: int = 0, seed_per_row: bool = False) -> Randomness:
    return Randomness(_rows([b * 7919 + 17 + salt for b in range(batch)]), _rows([3 + salt] * batch), seed_per_row)


def _layout(logits: torch.Tensor, layout: str) -> torch.Tensor:
    """``logits`` [..., V] as a contiguous tensor or as a view of a buffer whose rows are padded to a multiple of 16
    ids (V = 1001 -> 1008: 16-byte aligned rows, so the CUDA kernels take the vector path with a partial tail)."""
    if layout == "contiguous":
        return logits.contiguous()
    vocab = logits.shape[-1]
    buffer = torch.zeros(*logits.shape[:-1], -(-(vocab + 1) // 16) * 16, dtype=logits.dtype, device=logits.device)
    buffer[..., :vocab] = logits
    return buffer[..., :vocab]


def _edges(vocab: int, widths) -> list[int]:
    """Vocabulary ids where tiling bugs hide: the first and last two ids; for each width, the first two boundaries
    and the last one (each +-1); the start of the last partial 16-byte vector (4 lanes for fp32, 8 for fp16/bf16)."""
    ids = {0, 1, vocab - 2, vocab - 1}
    for width in widths:
        for edge in (width, 2 * width, (vocab - 1) // width * width):
            ids |= {edge - 1, edge, edge + 1}
    for lanes in (4, 8):
        ids.add(vocab - (vocab % lanes or lanes))
    return sorted(i for i in ids if 0 <= i < vocab)


def _noise(batch: int, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, rows, vocab, generator=g) * 2.0


def _plant(logits: torch.Tensor, winners: torch.Tensor) -> torch.Tensor:
    """logits [B, J, V] with WINNER written at winners [B, J]."""
    return logits.scatter(-1, winners.unsqueeze(-1).cpu(), WINNER)


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu()), f"\n{a}\n!=\n{b}"


# ---- planted winners ----------------------------------------------------------------------------------------------
PLANTED_GPU = [(backend, dtype, vocab, layout) for backend in ("cuda", "cuda-fused", "triton") for dtype in DTYPES
               for vocab, layout in ((1001, "padded"), (1001, "contiguous"), (6149, "padded"), (151936, "contiguous"),
                                     (256000, "padded"))]
PLANTED_CPU = [("triton", torch.bfloat16, 1001, "padded"),  # one chunk per row: the tail and the last vector
               ("triton-split", torch.float32, 161, "contiguous"),  # 32-wide tiles, two race chunks
               *[("torch", dtype, 6149, "padded") for dtype in DTYPES]]


def _planted_case(name: str, vocab: int, k: int, seed: int):
    """One row per edge id of the backend at this size (the plan depends on the batch: settle it first); winners
    [B, K+1]: row b's planted id at position j is edge (b + j) mod B, so every edge is tried at every position."""
    batch = 8
    for _ in range(4):
        edges = _edges(vocab, _chunk_widths(name, batch, k, vocab))
        if len(edges) == batch:
            break
        batch = len(edges)
    index = (torch.arange(batch).unsqueeze(1) + torch.arange(k + 1).unsqueeze(0)) % batch
    winners = torch.tensor(edges)[index]
    return batch, winners, _noise(batch, k + 1, vocab, seed)


def _check_planted_greedy(name, dtype, vocab, layout):
    verify, sample = _backend(name)
    k = 2
    batch, winners, noise = _planted_case(name, vocab, k, seed=vocab)
    target = _layout(_plant(noise, winners).to(DEVICE, dtype), layout)
    draft = _layout(noise[:, :k].to(DEVICE, dtype), layout)
    tokens = winners[:, :k].clone()
    tokens[1::2, 1] = (tokens[1::2, 1] + 1) % vocab  # odd rows: rejected at position 1
    tokens = tokens.to(DEVICE)
    randomness = _randomness(batch)
    n_want = torch.where(torch.arange(batch) % 2 == 0, k, 1)
    for d in (draft, None):
        out, n = verify(target, d, tokens, GREEDY, randomness)
        assert torch.equal(n.cpu(), n_want)
        assert torch.equal(out.cpu().gather(1, n_want.unsqueeze(1)).squeeze(1), winners.gather(1, n_want.unsqueeze(1)).squeeze(1))
        _assert_same((out, n), verify_reference(target, d, tokens, GREEDY, randomness))
    assert torch.equal(sample(target[:, 0], GREEDY, randomness).cpu(), winners[:, 0])


def _check_planted_races(name, dtype, vocab, layout, warp):
    """p (the sampler; the bonus token), the residual after a rejection (dense and one-hot q)."""
    verify, sample = _backend(name)
    k = 2
    batch, winners, noise = _planted_case(name, vocab, k, seed=vocab + 1)
    target = _layout(_plant(noise, winners).to(DEVICE, dtype), layout)
    args = (Sampling(*warp), _randomness(batch, salt=5))

    got = sample(target[:, 0], *args)
    assert torch.equal(got.cpu(), winners[:, 0])
    _assert_same([got], [sample_reference(target[:, 0], *args)])

    # Rejected at 0: the draft is sure of another id x (p(x) ~ e^-40), so the residual is ~ p, won by the winner.
    others = (winners[:, :k] + vocab // 2) % vocab
    draft = _layout(_plant(noise[:, :k], others).to(DEVICE, dtype), layout)
    tokens = others.to(DEVICE)
    for d in (draft, None):
        out, n = verify(target, d, tokens, *args)
        assert (n == 0).all(), n
        assert torch.equal(out[:, 0].cpu(), winners[:, 0])
        _assert_same((out, n), verify_reference(target, d, tokens, *args))

    # Every draft accepted (q = p bitwise: the same logits), then the bonus token from p_K: the winner at K.
    same = _layout(_plant(noise[:, :k], winners[:, :k]).to(DEVICE, dtype), layout)
    tokens = winners[:, :k].to(DEVICE)
    out, n = verify(target, same, tokens, *args)
    assert (n == k).all(), n
    assert torch.equal(out[:, k].cpu(), winners[:, k])
    _assert_same((out, n), verify_reference(target, same, tokens, *args))


PLANTED_WARPS = [(0.8, 0, 1.0), (1.0, 50, 0.9)]


@gpu
@pytest.mark.parametrize("name,dtype,vocab,layout", PLANTED_GPU, ids=str)
def test_planted_winner_greedy(name, dtype, vocab, layout):
    _check_planted_greedy(name, dtype, vocab, layout)


@gpu
@pytest.mark.parametrize("warp", PLANTED_WARPS, ids=str)
@pytest.mark.parametrize("name,dtype,vocab,layout", PLANTED_GPU, ids=str)
def test_planted_winner_races(name, dtype, vocab, layout, warp):
    _check_planted_races(name, dtype, vocab, layout, warp)


@cpu_only
@pytest.mark.parametrize("name,dtype,vocab,layout", PLANTED_CPU, ids=str)
def test_planted_winner_small(name, dtype, vocab, layout):
    if name != "triton-split":  # (the interpreter is slow; greedy with split tiles: test_triton_ops' ties test)
        _check_planted_greedy(name, dtype, vocab, layout)
    _check_planted_races(name, dtype, vocab, layout, PLANTED_WARPS[1])


# ---- exact-arithmetic replay: uniform p and q over random supports -------------------------------------------------
def _support_logits(batch: int, rows: int, vocab: int, size: int, g: torch.Generator) -> torch.Tensor:
    """[batch, rows, V] float32: 0 on ``size`` random ids of each row, -inf elsewhere."""
    ids = torch.rand(batch, rows, vocab, generator=g).argsort(dim=-1)[..., :size]
    return torch.full((batch, rows, vocab), float("-inf")).scatter(-1, ids, 0.0)


def _draw_from(logits: torch.Tensor, warp, g: torch.Generator) -> torch.Tensor:
    """One id per row of logits [B, J, V] drawn from the warped distribution q (as a drafter would)."""
    probs = torch.softmax(warp_logits(logits.flatten(0, 1), *warp), dim=-1)
    return torch.multinomial(probs, 1, generator=g).reshape(logits.shape[:2])


EXACT_WARPS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 7, 1.0), (0.9, 0, 0.5), (1.0, 5, 0.8)]


def _check_exact_replay(name, dtype, batch, vocab, layout, warps=EXACT_WARPS):
    """Dense-q residual after rejections, and the bonus token after full acceptance: torch.equal with the reference."""
    verify, sample = _backend(name)
    k = 3
    g = torch.Generator().manual_seed(vocab + batch)
    target = _support_logits(batch, k + 1, vocab, max(1, vocab // 3), g)
    draft_cpu = _support_logits(batch, k, vocab, max(1, vocab // 2), g)
    bonus_target = torch.cat([draft_cpu, target[:, k:]], dim=1)  # p = q at every draft position: all accepted
    target, draft, bonus_target = (_layout(t.to(DEVICE, dtype), layout) for t in (target, draft_cpu, bonus_target))
    rejected = 0
    for warp in warps:
        tokens = _draw_from(draft_cpu, warp, g).to(DEVICE)
        args = (Sampling(*warp), _randomness(batch, salt=int(warp[0] * 10) + warp[1], seed_per_row=batch % 2 == 1))
        got = verify(target, draft, tokens, *args)
        _assert_same(got, verify_reference(target, draft, tokens, *args))
        rejected += int((got[1] < k).sum())
        got = verify(bonus_target, draft, tokens, *args)
        assert (got[1] == k).all(), got[1]
        _assert_same(got, verify_reference(bonus_target, draft, tokens, *args))
        _assert_same([sample(target[:, 0], *args)], [sample_reference(target[:, 0], *args)])
    assert vocab <= 2 or rejected > 0  # the residual race ran


def _check_zero_residual_fallback(name, dtype, vocab, layout, batch=32):
    """q == p and a draft token outside the top-k (p = q = 0): rejected at 0 with an all-zero residual, so the next
    token is the race over p_0 (the residual race would give id 0, kept out of the top-k here), bit for bit; the
    cut ids, whose p is 0, take the race's no-random-number shortcut (a cut id given a positive key there wins a
    row's race with probability exp(-2) at key 1/2: 32 rows see it)."""
    verify, _ = _backend(name)
    k = 2
    g = torch.Generator().manual_seed(vocab + 29)
    target = torch.randn(batch, k + 1, vocab, generator=g) * 2.0
    target[..., 0] = -20.0
    tokens = target[:, :k].argmin(dim=-1)
    target = _layout(target.to(DEVICE, dtype), layout)
    draft = _layout(target[:, :k].clone(), layout)
    args = (Sampling(0.9, 5, 1.0), _randomness(batch, salt=13))
    out, n = verify(target, draft, tokens.to(DEVICE), *args)
    assert (n == 0).all(), n
    kth = target[:, 0].float().topk(5, dim=-1).values[:, -1]  # ties with the 5th value are kept too
    assert (target[:, 0].float().gather(1, out[:, :1]).squeeze(1) >= kth).all()
    _assert_same((out, n), verify_reference(target, draft, tokens.to(DEVICE), *args))


@gpu
@pytest.mark.parametrize("name", ["cuda", "cuda-split", "cuda-fused", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_residual_falls_back_to_p_bit_for_bit(name, dtype):
    _check_zero_residual_fallback(name, dtype, 6149, "padded")


def _check_zero_residual_without_a_cut(name, dtype, vocab, layout, batch=8, temperatures=(1.0, 0.8)):
    """Every residual 0 with no cut, so every id but one takes the race's full path (a random number, both keys):
    q == p (draft logits equal to the target's) on even rows, a one-hot q on a one-hot p at id h_b on odd rows. The
    draft token x_b has logit -inf (p = q = 0), so it is rejected at 0 and the next token is the race over p_0 (on the
    odd rows h_b), bit for bit. The race over p is skipped where it cannot decide the row (a positive residual seen):
    a kernel that runs it only where the residual is positive, or never, fails here."""
    verify, _ = _backend(name)
    k = 2
    g = torch.Generator().manual_seed(vocab + 31)
    target = torch.randn(batch, k + 1, vocab, generator=g) * 2.0
    hot = torch.randint(1, vocab, (batch,), generator=g)  # (not id 0: a wrong race's first tie)
    for b in range(1, batch, 2):
        target[b] = torch.full((k + 1, vocab), float("-inf")).index_fill(-1, hot[b : b + 1], 0.0)
    tokens = (hot + torch.randint(1, vocab, (batch,), generator=g)) % vocab  # x_b != h_b
    target.scatter_(-1, tokens.view(batch, 1, 1).expand(batch, k + 1, 1), float("-inf"))
    target = _layout(target.to(DEVICE, dtype), layout)
    draft = _layout(target[:, :k].clone(), layout)
    drafted = tokens.view(batch, 1).expand(batch, k).contiguous().to(DEVICE)
    for temperature in temperatures:
        args = (Sampling(temperature, 0, 1.0), _randomness(batch, salt=17))
        out, n = verify(target, draft, drafted, *args)
        assert (n == 0).all(), n
        assert torch.equal(out[1::2, 0].cpu(), hot[1::2]), (out[:, 0], hot)
        _assert_same((out, n), verify_reference(target, draft, drafted, *args))


@gpu
@pytest.mark.parametrize("name", ["cuda", "cuda-split", "cuda-fused", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_residual_without_a_cut(name, dtype):
    _check_zero_residual_without_a_cut(name, dtype, 6149, "padded", batch=32)


@cpu_only
@pytest.mark.parametrize("name,layout", [("triton", "padded"), ("triton-split", "contiguous")])
def test_zero_residual_without_a_cut_small(name, layout):
    _check_zero_residual_without_a_cut(name, torch.float32, 161, layout, batch=4, temperatures=(0.8,))


@gpu
@pytest.mark.parametrize("name", ["cuda", "cuda-split", "cuda-fused", "triton"])
@pytest.mark.parametrize("batch,vocab,layout", [(64, 2, "contiguous"), (64, 1001, "padded"), (16, 6144, "padded"),
                                                (256, 32000, "contiguous"), (4, 256000, "padded")], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_exact_replay_of_residual_and_bonus(name, dtype, batch, vocab, layout):
    _check_exact_replay(name, dtype, batch, vocab, layout)


@cpu_only
@pytest.mark.parametrize("name,dtype,batch,vocab,layout", [("triton", torch.float32, 4, 2, "contiguous"),
                                                           ("triton-split", torch.bfloat16, 3, 161, "padded")],
                         ids=str)
def test_exact_replay_small(name, dtype, batch, vocab, layout):
    _check_exact_replay(name, dtype, batch, vocab, layout, warps=EXACT_WARPS[::4])


# ---- a vocabulary of one id -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cuda", "cuda-split", "cuda-fused", "triton"] if ON_CUDA else ["triton"])
def test_vocabulary_of_one(name):
    """V = 1: every draft is the only id, p = q = 1, so all are accepted and the bonus token is 0, in every mode."""
    verify, sample = _backend(name)
    batch, k = 3, 2
    target = torch.zeros(batch, k + 1, 1, device=DEVICE)
    tokens = torch.zeros(batch, k, dtype=torch.int64, device=DEVICE)
    randomness = _randomness(batch)
    for sampling in (GREEDY, Sampling(1.0, 0, 1.0), Sampling(0.7, 1, 0.5)):
        for draft in (target[:, :k], None):
            out, n = verify(target, draft, tokens, sampling, randomness)
            assert (n == k).all() and (out == 0).all()
            _assert_same((out, n), verify_reference(target, draft, tokens, sampling, randomness))
        assert (sample(target[:, 0], sampling, randomness) == 0).all()


# ---- no draft position ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cuda", "cuda-split", "cuda-fused", "triton"] if ON_CUDA else ["triton"])
def test_no_draft_position_with_an_empty_draft(name):
    """K = 0 with a draft tensor [B, 0, V] (the backends' own entry points take it; ops.verify refuses K < 1): only
    the bonus token, drawn from p. With a top-k/top-p cut the Triton race read the draft's cut at index -1 (a
    segfault under the interpreter, an illegal address on a GPU); q is never read there."""
    verify, _ = _backend(name)
    batch, vocab = 2, 16
    target = torch.randn(batch, 1, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    draft = torch.empty(batch, 0, vocab, device=DEVICE)
    tokens = torch.empty(batch, 0, dtype=torch.int64, device=DEVICE)
    randomness = _randomness(batch)
    for sampling in (GREEDY, Sampling(1.0, 4, 1.0), Sampling(0.8, 0, 0.6)):
        _assert_same(verify(target, draft, tokens, sampling, randomness),
                     verify_reference(target, draft, tokens, sampling, randomness))


# ---- the streaming passes' shortcuts: per-vector max, first index by selects, NaN/+inf by a NaN-propagating max -----
SHORTCUT_GPU = [(backend, dtype, vocab, layout) for backend in ("cuda", "cuda-fused", "triton") for dtype in DTYPES
                for vocab, layout in ((1001, "padded"), (1001, "contiguous"), (6149, "padded"))]
SHORTCUT_CPU = [("triton", torch.bfloat16, 1001, "padded"), ("triton-split", torch.float32, 161, "contiguous")]
# Temperatures with an exact reciprocal (z = x * (1/T) in the CUDA pass) and without; cuts with ties at the cut.
SHORTCUT_WARPS = [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 3, 1.0), (0.7, 0, 1.0), (0.25, 0, 0.5)]


def _tie_pairs(vocab: int) -> list[tuple[int, int]]:
    """(first, second) ids sharing a row's maximum: in one 16-byte vector, across a vector edge, in two vectors of one
    CUDA thread (64 threads x 8 ids apart), in two threads, across the 2048-id chunk edge, in the tail, first and
    last."""
    pairs = [(8, 13), (7, 8), (3, 515), (5, 6 + 8 * 17), (0, vocab - 1), (vocab - 9, vocab - 1), (vocab - 2, vocab - 1)]
    if vocab > 2048:
        pairs += [(2047, 2048), (100, 2048 + 100), (2048, 4095)]
    return [(a, b) for a, b in pairs if 0 <= a < b < vocab]


def _check_shortcut_ties(name, dtype, vocab, layout):
    """Greedy: ties go to the first id wherever the two copies sit; -0 and +0 are equal (the first wins)."""
    verify, sample = _backend(name)
    pairs = _tie_pairs(vocab)
    batch, k = len(pairs) + 2, 1
    logits = -1.0 - _noise(batch, k + 1, vocab, seed=vocab + 3).abs()  # all < 0
    first = []
    for b, (i, j) in enumerate(pairs):
        logits[b, :, i] = logits[b, :, j] = WINNER
        first.append(i)
    zeros = pairs[0]
    logits[-2, :, zeros[0]], logits[-2, :, zeros[1]] = -0.0, 0.0
    logits[-1, :, zeros[0]], logits[-1, :, zeros[1]] = 0.0, -0.0
    first += [zeros[0], zeros[0]]
    target = _layout(logits.to(DEVICE, dtype), layout)
    first = torch.tensor(first)
    tokens = first.unsqueeze(1).to(DEVICE)  # accepted: the bonus is the first id again
    randomness = _randomness(batch)
    out, n = verify(target, None, tokens, GREEDY, randomness)
    assert (n == k).all() and torch.equal(out.cpu(), first.unsqueeze(1).expand(-1, k + 1))
    _assert_same((out, n), verify_reference(target, None, tokens, GREEDY, randomness))
    assert torch.equal(sample(target[:, 0], GREEDY, randomness).cpu(), first)


def _check_shortcut_flags(name, dtype, vocab, layout, warps=SHORTCUT_WARPS):
    """NaN / +inf next to the maximum, before and after it in its vector, at the first, last, tail and chunk-edge ids,
    and all--inf positions: the row is invalid (-1) in greedy and at every temperature (exact reciprocal or not); the
    other rows are exact uniform distributions ({0, -inf} logits), so every row must equal the reference."""
    verify, sample = _backend(name)
    k = 2
    places = {0, 1, 6, 7, 8, 9, vocab // 2, vocab - 9, vocab - 2, vocab - 1} | ({2047, 2048} if vocab > 2048 else set())
    places = sorted(places)
    bad = [(value, place) for value in (float("nan"), float("inf")) for place in places] + [("-inf row", 0)]
    batch = len(bad) + 3  # three clean rows
    g = torch.Generator().manual_seed(vocab + 11)
    logits = _support_logits(batch, k + 1, vocab, max(2, vocab // 3), g)
    for b, (value, place) in enumerate(bad):
        j = b % (k + 1)
        if value == "-inf row":
            logits[b, j] = float("-inf")
        else:
            logits[b, j, max(place - 1, 0)] = logits[b, j, min(place + 1, vocab - 1)] = 0.0  # the max beside it
            logits[b, j, place] = value
    target = _layout(logits.to(DEVICE, dtype), layout)
    draft = _layout(logits[:, :k].flip(0).to(DEVICE, dtype), layout)  # bad values in draft rows too
    tokens = torch.zeros(batch, k, dtype=torch.int64, device=DEVICE)
    for i, sampling in enumerate([GREEDY] + [Sampling(*warp) for warp in warps]):
        randomness = _randomness(batch, salt=i)
        for d in (draft, None):
            got = verify(target, d, tokens, sampling, randomness)
            assert d is not None or (got[1][:len(bad)] == -1).all(), got[1]
            _assert_same(got, verify_reference(target, d, tokens, sampling, randomness))
        got = sample(target[:, 0], sampling, randomness)
        _assert_same([got], [sample_reference(target[:, 0], sampling, randomness)])


def _check_shortcut_row_params(name, dtype, vocab, layout):
    """Per-row parameters: a greedy row in a sampling launch takes its argmax (ties: the first id) from the pass's
    z = x * 1; a row scaled by a power of two or not is judged on its own z (0.9 x the dtype's largest value
    overflows at T = 0.5 and 0.7). Each row is 0 at a tied pair and -inf elsewhere: p = 1/2 exactly."""
    from speculative_kernels.ops.validation import check_sampling

    verify, sample = _backend(name)
    pairs = _tie_pairs(vocab)
    kinds = [(0.0, 0, 1.0), (0.5, 0, 1.0), (0.7, 2, 1.0), (1.0, 0, 0.5), (2.0, 0, 1.0)]
    batch, k = len(pairs) * len(kinds), 1
    logits = torch.full((batch, k + 1, vocab), float("-inf"))
    for b in range(batch):
        i, j = pairs[b // len(kinds)]
        logits[b, :, i] = logits[b, :, j] = 0.0
    huge = float(torch.finfo(dtype).max) * 0.9 if dtype != torch.float16 else None
    if huge is not None:
        logits[1, 0, pairs[0][1]] = logits[2, 0, pairs[0][1]] = huge  # overflows when scaled: rows 1, 2 invalid
    t, top_k, top_p = (torch.tensor(v).repeat(len(pairs)) for v in zip(*kinds))
    sampling = check_sampling(t.float().to(DEVICE), top_k.to(DEVICE), top_p.double().to(DEVICE), batch,
                              torch.device(DEVICE))
    target = _layout(logits.to(DEVICE, dtype), layout)
    tokens = torch.tensor([pairs[b // len(kinds)][0] for b in range(batch)]).unsqueeze(1).to(DEVICE)
    randomness = _randomness(batch)
    got = verify(target, None, tokens, sampling, randomness)
    _assert_same(got, verify_reference(target, None, tokens, sampling, randomness))
    greedy = torch.arange(batch) % len(kinds) == 0
    assert (got[1].cpu()[greedy] == k).all()
    if huge is not None:
        assert (got[1].cpu()[1:3] == -1).all()
    _assert_same([sample(target[:, 0], sampling, randomness)], [sample_reference(target[:, 0], sampling, randomness)])


@gpu
@pytest.mark.parametrize("name,dtype,vocab,layout", SHORTCUT_GPU, ids=str)
def test_streaming_shortcuts(name, dtype, vocab, layout):
    _check_shortcut_ties(name, dtype, vocab, layout)
    _check_shortcut_flags(name, dtype, vocab, layout)
    _check_shortcut_row_params(name, dtype, vocab, layout)


@cpu_only
@pytest.mark.parametrize("name,dtype,vocab,layout", SHORTCUT_CPU, ids=str)
def test_streaming_shortcuts_small(name, dtype, vocab, layout):
    _check_shortcut_ties(name, dtype, vocab, layout)
    if name == "triton":  # (the interpreter is slow: one sampling case each)
        _check_shortcut_flags(name, dtype, vocab, layout, warps=SHORTCUT_WARPS[4:])
        _check_shortcut_row_params(name, dtype, vocab, layout)
    else:
        _check_shortcut_flags(name, dtype, vocab, layout, warps=SHORTCUT_WARPS[3:4])


@gpu
def test_an_unknown_passes_setting_is_refused_by_name(monkeypatch):
    """SPECULATIVE_KERNELS_VERIFY_PASSES is a benchmarking knob, but a typo must not silently mean the default."""
    verify, sample = _backend("cuda")
    target = torch.randn(2, 3, 64, device=DEVICE)
    tokens = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    monkeypatch.setenv(PASSES_VARIABLE, "fuse")
    with pytest.raises(ValueError, match="SPECULATIVE_KERNELS_VERIFY_PASSES must be 'split', 'fused' or unset"):
        verify(target, None, tokens, Sampling(1.0, 0, 1.0), _randomness(2))
    with pytest.raises(ValueError, match="SPECULATIVE_KERNELS_VERIFY_PASSES"):
        sample(target[:, 0], Sampling(1.0, 0, 1.0), _randomness(2))
    for value in ("split", "fused", ""):
        monkeypatch.setenv(PASSES_VARIABLE, value)
        _assert_same(verify(target, None, tokens, Sampling(1.0, 0, 1.0), _randomness(2)),
                     verify_reference(target, None, tokens, Sampling(1.0, 0, 1.0), _randomness(2)))
