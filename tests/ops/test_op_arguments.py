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
    """A scalar the scalar path accepts (top_k past int64: no cut; float32's largest temperature) used to raise
    torch's overflow RuntimeError once another parameter was a tensor. (A temperature above float32's largest value
    is refused: test_a_temperature_above_float32s_largest_value_is_refused_by_name.)"""
    target, draft, tokens = _inputs()
    alone = ops.sample(target[:, 0], top_k=2**63, temperature=0.7, seed=3)
    mixed = ops.sample(target[:, 0], top_k=2**63, temperature=torch.full((2,), 0.7), seed=3)
    assert torch.equal(alone, mixed)
    hottest = torch.finfo(torch.float32).max
    alone = ops.verify(target, draft, tokens, temperature=hottest, top_k=4, seed=3)
    mixed = ops.verify(target, draft, tokens, temperature=hottest, top_k=torch.tensor([4, 4]), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(alone, mixed)) and (alone[1] >= 0).all()


TOO_HOT = r"temperature=1e\+39 exceeds float32's largest value \(3.40282347e\+38\)"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_temperature_above_float32s_largest_value_is_refused_by_name(backend):
    """temperature=1e39 (HF divides float32 logits by it: every logit 0, a uniform draw) had three behaviours: the
    all-scalar torch call drew uniformly; beside a per-row top_k/top_p tensor it was clamped to float32's largest
    value, which keeps the logits' order, so top_k=2 drew from 2 tokens, silently; the Triton backend flagged every
    row ('invalid input in batch rows [0, 1]', naming nothing); a float64 [B] tensor of it was refused as 'got inf'.
    It is refused by name everywhere (as SpeculativeDecoder.add_request does), scalar or tensor."""
    target, draft, tokens = _inputs(vocab=9)
    calls = (lambda **kw: ops.verify(target, draft, tokens, seed=1, backend=backend, **kw),
             lambda **kw: ops.sample(target[:, 0], seed=1, backend=backend, **kw))
    for call in calls:
        for extra in ({}, {"top_k": torch.tensor([2, 2])}, {"top_p": torch.tensor([0.5, 0.5])}):
            with pytest.raises(ValueError, match=TOO_HOT + r": the ops hold the temperature in float32"):
                call(temperature=1e39, **extra)
    # in a float64 [B] tensor: named by the value given, with its row (also one that rounds down to float32's max)
    rounds_down = torch.finfo(torch.float32).max * (1 + 2**-30)
    temperature = torch.tensor([1.0, 1e39], dtype=torch.float64)
    with pytest.raises(ValueError, match=TOO_HOT + r".*\(batch rows \[1\]\)"):
        calls[1](temperature=temperature)
    if backend == "torch":
        with pytest.raises(ValueError, match=r"temperature=3.40282\d*e\+38 exceeds .*\(batch rows \[0\]\)"):
            calls[0](temperature=torch.tensor([rounds_down, 1.0], dtype=torch.float64))
        out, n = calls[0](temperature=temperature, check=False)
        assert n.tolist()[1] == -1 and n[0] >= 0 and (out[1] == -1).all()


def test_check_true_under_torch_compile_is_refused_by_name():
    """check=True inside torch.compile(fullgraph=True) failed inside dynamo (GuardOnDataDependentSymNode from
    reading the flagged rows): the error now says that the checks cannot run while compiling, naming check.
    check=None (the default) skips them there, as documented."""
    target, draft, tokens = _inputs()

    def step(check):
        return torch.compile(lambda t, d, x: ops.verify(t, d, x, temperature=0.8, seed=torch.tensor(3), check=check,
                                                        backend="torch"), fullgraph=True, backend="eager")

    with pytest.raises(Exception, match=r"check=True reads the result on the host, which cannot run while compiling"):
        step(True)(target, draft, tokens)
    eager = ops.verify(target, draft, tokens, temperature=0.8, seed=torch.tensor(3), backend="torch")
    for check in (None, False):
        assert all(torch.equal(a, b) for a, b in zip(step(check)(target, draft, tokens), eager))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_top_k_past_int64_is_no_cut_on_every_backend(backend):
    """top_k=2**63 (no cut, as in HF's TopKLogitsWarper) crashed inside torch's dispatcher on the Triton backend: its
    registered ops take a 64-bit int ('Expected a value of type int for argument top_k')."""
    target, draft, tokens = _inputs(vocab=9)
    for top_k in (2**63, 10**30):
        big = ops.verify(target, draft, tokens, temperature=0.9, top_k=top_k, seed=1, backend=backend)
        none = ops.verify(target, draft, tokens, temperature=0.9, top_k=0, seed=1, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(big, none))
        assert torch.equal(ops.sample(target[:, 0], temperature=0.9, top_k=top_k, seed=1, backend=backend),
                           ops.sample(target[:, 0], temperature=0.9, seed=1, backend=backend))


def test_a_seed_tensor_of_one_value_per_row_is_each_rows_own_key():
    """Documented (verify's docstring, README): a [B] seed is each row's own key, so seed=torch.full((B,), s) draws
    the same numbers in every row (identical rows, identical samples), unlike seed=s; row_keys gives independent
    keys."""
    logits = torch.zeros(64, 1000)  # uniform: the draws are the random numbers themselves
    broadcast = ops.sample(logits, seed=torch.full((64,), 7))
    assert broadcast.unique().numel() == 1
    assert ops.sample(logits, seed=7).unique().numel() > 32
    keys = ops.randomness.row_keys(torch.full((64,), 7))
    assert ops.sample(logits, seed=keys).unique().numel() > 32


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


def test_out_of_range_flags_offsets_from_2_to_the_32():
    """Device-tensor offsets are checked with the op's result, through out_of_range (CPU tensors on entry)."""
    from speculative_kernels.ops.randomness import Randomness

    rows = Randomness(torch.tensor([0, 0, 0, -1]), torch.tensor([0, 2**32 - 1, 2**32, 0]))
    assert rows.out_of_range().tolist() == [False, False, True, True]
