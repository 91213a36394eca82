"""The torch backend's greedy verification (``torch_backend.verify_greedy``) against the reference, bit for bit:
random logits with ties, NaN / +inf / all -inf rows in either model's logits, draft tokens outside the vocabulary,
q given or None, every float dtype."""

import pytest
import torch

from speculative_kernels.ops.randomness import Randomness
from speculative_kernels.ops.reference import verify_reference
from speculative_kernels.ops.sampling import GREEDY
from speculative_kernels.ops.torch_backend import verify_greedy


def _case(g: torch.Generator, dtype: torch.dtype):
    batch, num_draft, vocab = (int(x) for x in torch.randint(1, 6, (3,), generator=g))
    vocab *= 3
    target = torch.randint(-3, 3, (batch, num_draft + 1, vocab), generator=g).to(dtype)  # small ints: many ties
    draft = torch.randint(-3, 3, (batch, num_draft, vocab), generator=g).to(dtype)
    best = target.float().argmax(dim=-1)[:, :num_draft]
    agree = torch.rand(batch, num_draft, generator=g) < 0.7
    tokens = torch.where(agree, best, torch.randint(0, vocab, (batch, num_draft), generator=g))
    r = torch.rand(6, generator=g)
    if r[0] < 0.15:
        target[0, int(torch.randint(0, num_draft + 1, (), generator=g)), 0] = float("nan")
    if r[1] < 0.15:
        target[-1, 0, 1] = float("inf")
    if r[2] < 0.15:
        target[0, num_draft, :] = float("-inf")
    if r[3] < 0.15:
        draft[-1, 0, 2] = float("nan")
    if r[4] < 0.15:
        tokens[0, 0] = vocab if r[5] < 0.5 else -1
    if r[5] < 0.15:
        draft[0, -1, :] = float("-inf")
    return target, draft, tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_verify_greedy_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    invalid_seen = 0
    for _ in range(200):
        target, draft, tokens = _case(g, dtype)
        zeros = torch.zeros(tokens.shape[0], dtype=torch.int64)
        for q in (draft, None):
            want = verify_reference(target, q, tokens, GREEDY, Randomness(zeros, zeros))
            got = verify_greedy(target, q, tokens)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            invalid_seen += int((want[1] < 0).any())
    assert invalid_seen > 20  # the invalid cases were exercised


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_greedy_call_leaves_torch_generator_untouched(backend):
    """Greedy verification and sampling use no random number; with no seed they drew one from torch's default
    generator anyway, which moved it (HF's greedy decoding does not): the next torch.rand differed. Per-row
    temperatures are device values, so such a call still draws its seed."""
    from speculative_kernels import ops

    target, draft = torch.randn(2, 4, 30), torch.randn(2, 3, 30)
    tokens = target[:, :3].argmax(dim=-1)
    state = torch.get_rng_state()
    ops.verify(target, draft, tokens, temperature=0.0, backend=backend)
    ops.sample(draft[:, 0], temperature=0.0, backend=backend)
    assert torch.equal(torch.get_rng_state(), state)
    ops.verify(target, draft, tokens, temperature=torch.zeros(2), backend=backend)
    assert not torch.equal(torch.get_rng_state(), state)
