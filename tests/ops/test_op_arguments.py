"""Arguments of the public ops at their edges (found by a hunt of the ops' surface): what used to give a silently
wrong result or an error that did not name the argument. Torch backend; the Triton reading of strided per-row
tensors is in test_triton_ops.py."""

import pytest
import torch

from speculative_kernels import ops


def _inputs(batch=2, k=2, vocab=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g) * 2
    draft = torch.randn(batch, k, vocab, generator=g) * 2
    tokens = torch.randint(0, vocab, (batch, k), generator=g)
    return target, draft, tokens


def test_a_float64_temperature_that_rounds_to_zero_in_float32_is_refused_not_greedy():
    """1e-50 as a scalar is refused (below float32's smallest normal); in a float64 [B] tensor it rounded to 0 in
    float32 and made its row greedy, silently."""
    target, draft, tokens = _inputs()
    temperature = torch.tensor([1e-50, 1.0], dtype=torch.float64)
    for call in (lambda **kw: ops.verify(target, draft, tokens, **kw), lambda **kw: ops.sample(target[:, 0], **kw)):
        with pytest.raises(ValueError, match=r"temperature is below float32's smallest normal.*batch rows \[0\]"):
            call(temperature=temperature, seed=1)
    out, n = ops.verify(target, draft, tokens, temperature=temperature, seed=1, check=False)
    assert n[0] == -1 and (out[0] == -1).all() and n[1] >= 0
    exact_zero = torch.tensor([0.0, 1.0], dtype=torch.float64)  # 0 stays greedy
    ops.verify(target, draft, tokens, temperature=exact_zero, seed=1)


def test_scalars_beside_a_per_row_tensor_are_taken_as_alone():
    """A scalar the scalar path accepts (top_k past int64: no cut; a temperature past float32's range) used to raise
    torch's overflow RuntimeError once another parameter was a tensor."""
    target, draft, tokens = _inputs()
    alone = ops.sample(target[:, 0], top_k=2**63, temperature=0.7, seed=3)
    mixed = ops.sample(target[:, 0], top_k=2**63, temperature=torch.full((2,), 0.7), seed=3)
    assert torch.equal(alone, mixed)
    hot = ops.verify(target, draft, tokens, temperature=1e300, top_k=torch.tensor([0, 4]), seed=3)
    assert (hot[1] >= 0).all()


def test_a_bad_seed_in_a_tensor_is_named_by_its_value():
    """seed=torch.tensor([7, -5, 9]) used to say 'got 7' (an int64 compared with 2**63 is always >= it)."""
    target, draft, tokens = _inputs(batch=3)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\), got -5"):
        ops.verify(target, draft, tokens, seed=torch.tensor([7, -5, 9]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prompt_lookup_refuses_an_empty_buffer_and_out_of_range_rows(backend):
    """W = 0 segfaulted the Triton kernel; end = 0 or end > W read out of bounds there (and raised gather's
    RuntimeError on torch). CPU tensors are range-checked (no device read)."""
    tokens = torch.tensor([[5, 6, 5, 6, 5]])
    with pytest.raises(ValueError, match=r"W >= 1"):
        ops.prompt_lookup(tokens[:, :0], torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                          num_tokens=2, backend=backend)
    for start, end in ((0, 0), (0, 9), (-1, 3), (4, 3)):
        with pytest.raises(ValueError, match=r"start and end must satisfy.*batch rows \[0\]"):
            ops.prompt_lookup(tokens, torch.tensor([start]), torch.tensor([end]), num_tokens=2, backend=backend)
    proposal, count = ops.prompt_lookup(tokens, torch.tensor([0]), torch.tensor([5]), num_tokens=2, backend=backend)
    assert proposal.tolist() == [[6, 5]] and count.tolist() == [2]
    with pytest.raises(TypeError, match="prefer_latest must be a bool"):
        ops.prompt_lookup(tokens, torch.tensor([0]), torch.tensor([5]), num_tokens=2, prefer_latest="no")


def test_compact_kv_refuses_aliased_tensors_and_moves_float8_bits():
    """The same tensor twice (or an expanded one) was compacted once per occurrence, corrupting it; float8 caches
    raised NotImplementedError from torch.gather on the torch backend (the Triton one copies their bits)."""
    mask = torch.tensor([[1, 0, 1, 1]])
    kv = torch.arange(8.0).reshape(1, 1, 4, 2)
    with pytest.raises(ValueError, match=r"kv\[1\] is the same memory as kv\[0\]"):
        ops.compact_kv([kv, kv], mask)
    with pytest.raises(ValueError, match=r"kv\[0\] has a stride-0"):
        ops.compact_kv(torch.arange(8.0).reshape(1, 1, 4, 2).expand(1, 3, 4, 2), mask)
    fused = torch.arange(16.0).reshape(1, 1, 4, 2, 2)  # K and V as views of one buffer: distinct memory
    ops.compact_kv([fused[..., 0], fused[..., 1]], mask)
    assert fused[0, 0, :3].flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    if not hasattr(torch, "float8_e4m3fn"):
        return
    values = torch.tensor([0.5, 1.0, 1.5, 2.0]).reshape(1, 1, 4, 1).expand(1, 2, 4, 3).contiguous()
    fp8 = values.to(torch.float8_e4m3fn)
    ops.compact_kv(fp8, mask, backend="torch")
    assert fp8.float()[0, 0, :3, 0].tolist() == [0.5, 1.5, 2.0]


def test_check_and_kv_of_other_types_are_refused_by_name():
    """check="no" was taken as true (bool of a string); a numpy kv failed with a message about kv[0]'s shape."""
    import numpy as np

    target, draft, tokens = _inputs()
    with pytest.raises(TypeError, match="check must be a bool or None, got str"):
        ops.verify(target, draft, tokens, seed=1, check="no")
    with pytest.raises(TypeError, match=r"kv must be a \[B, H, S, D\] tensor or a sequence of them, got ndarray"):
        ops.compact_kv(np.zeros((1, 1, 4, 2)), torch.tensor([[1, 0, 1, 1]]))


@pytest.mark.parametrize("where", ["meta", "fake"])
def test_shape_propagation_runs_without_reading_values(where):
    """On the meta device and under a FakeTensorMode (shape propagation, tracing) there are no values to read: the
    default check and a seed drawn for sampling read them anyway and failed (nonzero / a data-dependent scalar).
    The check is skipped there by default, as while compiling; check=True still asks for it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run():
        device = "meta" if where == "meta" else "cpu"
        target, draft = torch.randn(2, 4, 30, device=device), torch.randn(2, 3, 30, device=device)
        tokens = torch.zeros(2, 3, dtype=torch.int64, device=device)
        shapes = []
        for temperature, seed in ((0.0, None), (0.7, None), (torch.full((2,), 0.7, device=device), 3)):
            out, accepted = ops.verify(target, draft, tokens, temperature=temperature, seed=seed, backend="torch")
            shapes.append((tuple(out.shape), tuple(accepted.shape), out.dtype))
            shapes.append(tuple(ops.sample(draft[:, 0], temperature=temperature, seed=seed, backend="torch").shape))
        return shapes

    with FakeTensorMode() if where == "fake" else torch.device("cpu"):
        shapes = run()
    assert shapes == [((2, 4), (2,), torch.int64), (2,)] * 3
