"""The public ops under ``torch.compile(fullgraph=True)``: registration and tracing cannot rot silently.

``backend="torch"`` runs everywhere (CPU in CI); ``"triton"`` and ``"cuda"`` need a CUDA device (the Triton
interpreter cannot run on the fake tensors torch.compile traces with, and the CUDA extension needs a GPU). Compiled
results must equal the eager ones.

On CPU the compiler backend is ``aot_eager``: dynamo tracing, functionalization and the fake implementations are what
registration rot would break, while Inductor's C++ build of these graphs takes minutes on a 2-core CI machine (run by
hand, Inductor's CPU results equal eager on random inputs; on inputs built to sit on a decision boundary, an accept
draw r exactly equal to eager's p(x), its fused softmax rounds p an ulp differently and flips such a decision: the
compiled op is exact in distribution, not bit-identical to the eager one there). On CUDA the default Inductor backend
is used.
"""

import subprocess
import sys

import pytest
import torch

from speculative_kernels import ops

HAS_CUDA = torch.cuda.is_available()
WARPS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 20, 0.9)]



def _inputs(batch, k, vocab, device, dtype):
    g = torch.Generator().manual_seed(batch * 100 + k)
    target = torch.randn(batch, k + 1, vocab, generator=g) * 2
    draft = target[:, :k] + torch.randn(batch, k, vocab, generator=g)
    tokens = torch.multinomial(torch.softmax(draft.reshape(-1, vocab), -1), 1, generator=g).reshape(batch, k)
    return target.to(device, dtype), draft.to(device, dtype), tokens.to(device)


def _check_compiled_equals_eager(backend, device, dtype, warp, compiler="inductor"):
    temperature, top_k, top_p = warp
    target, draft, tokens = _inputs(3, 4, 1000, device, dtype)
    seed = torch.tensor([5, 6, 7], device=device)
    offset = torch.tensor([1, 1, 2], device=device)

    def step(t, d, x, s, o):
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, offset=o, backend=backend)
        out, n = ops.verify(t, d, x, **kw)
        one_hot_out, one_hot_n = ops.verify(t, None, x, **kw)
        drafted = ops.sample(t[:, 0], **kw)
        return out, n, one_hot_out, one_hot_n, drafted

    eager = step(target, draft, tokens, seed, offset)
    compiled = torch.compile(step, fullgraph=True, backend=compiler)(target, draft, tokens, seed, offset)
    for got, want in zip(compiled, eager):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("warp", WARPS, ids=["greedy", "plain", "topk-topp"])
def test_torch_backend_compiles_on_cpu(warp):
    torch._dynamo.reset()
    _check_compiled_equals_eager("torch", "cpu", torch.float32, warp, compiler="aot_eager")


@pytest.mark.skipif(not HAS_CUDA, reason="the Triton and CUDA backends need a CUDA device (CI has none)")
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
@pytest.mark.parametrize("warp", WARPS, ids=["greedy", "plain", "topk-topp"])
def test_backends_compile_on_cuda(backend, warp):
    torch._dynamo.reset()
    _check_compiled_equals_eager(backend, "cuda", torch.bfloat16, warp)


def _check_per_row_compiled_equals_eager(backend, device, dtype, compiler="inductor"):
    """Per-row temperature/top_k/top_p tensors (greedy rows included) and num_draft_tokens, compiled == eager."""
    target, draft, tokens = _inputs(4, 3, 1000, device, dtype)
    seed, offset = torch.tensor([5, 6, 7, 8], device=device), torch.tensor([1, 1, 2, 0], device=device)
    params = dict(temperature=torch.tensor([0.0, 0.7, 1.0, 1.3], device=device),
                  top_k=torch.tensor([0, 20, 0, 5], device=device),
                  top_p=torch.tensor([1.0, 0.9, 0.8, 1.0], device=device, dtype=torch.float64))
    limit = torch.tensor([3, 0, 2, 1], device=device)

    def step(t, d, x, s, o, nb, temperature, top_k, top_p):
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, offset=o, backend=backend)
        out, n = ops.verify(t, d, x, num_draft_tokens=nb, **kw)
        one_hot_out, one_hot_n = ops.verify(t, None, x, num_draft_tokens=nb, **kw)
        return out, n, one_hot_out, one_hot_n, ops.sample(t[:, 0], **kw)

    args = (target, draft, tokens, seed, offset, limit, *params.values())
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend=compiler)(*args)
    for got, want in zip(compiled, eager):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_torch_backend_per_row_compiles_on_cpu():
    torch._dynamo.reset()
    _check_per_row_compiled_equals_eager("torch", "cpu", torch.float32, compiler="aot_eager")


@pytest.mark.skipif(not HAS_CUDA, reason="the Triton and CUDA backends need a CUDA device (CI has none)")
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_backends_per_row_compile_on_cuda(backend):
    torch._dynamo.reset()
    _check_per_row_compiled_equals_eager(backend, "cuda", torch.bfloat16)


_COMPILE_FIRST = """
import sys, torch
from speculative_kernels import ops
assert "speculative_kernels.ops.torch_backend" not in sys.modules
assert "speculative_kernels.ops.compaction_torch" not in sys.modules
def step(t, d, x, s, o):
    return ops.verify(t, d, x, temperature=1.0, seed=s, offset=o, backend="auto")
g = torch.Generator().manual_seed(0)
t, d = torch.randn(2, 4, 50, generator=g), torch.randn(2, 3, 50, generator=g)
x, s, o = torch.randint(0, 50, (2, 3), generator=g), torch.tensor([1, 2]), torch.tensor([0, 3])
compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(t, d, x, s, o)
eager = step(t, d, x, s, o)
assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
kv, mask = torch.randn(2, 3, 8, 4, generator=g), (torch.rand(2, 8, generator=g) > 0.3).to(torch.int8)
compiled_kv, eager_kv = kv.clone(), kv.clone()
counts = torch.compile(ops.compact_kv, fullgraph=True, backend="aot_eager")(compiled_kv, mask)
assert torch.equal(counts, ops.compact_kv(eager_kv, mask)) and torch.equal(compiled_kv, eager_kv)
print("ok")
"""


def test_compile_before_any_eager_call():
    """A fresh process whose first call of an op is inside torch.compile(fullgraph=True): backend selection and the
    import of the backend module must not break the graph (a dynamo-untraceable import would)."""
    result = subprocess.run([sys.executable, "-c", _COMPILE_FIRST], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
