"""The Triton backend's eager fast path (``ops/eager.py``): in plain eager mode ``triton_backend.verify``/``sample``,
``compaction_triton.compact_kv`` and ``lookup_triton.prompt_lookup`` call the registered op's body directly, with the
kernels themselves, skipping torch's custom-op dispatch (80–110 µs of host time per call,
``benchmarks/triton_host_overhead.py``); everywhere else they call the registered op.

Deterministic checks, no timing: which Python layers a call goes through (``sys.setprofile``), when the fast path is
taken, that both paths launch the same kernels with the same arguments, and that the host plan's plain arithmetic is
Triton's."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or any kernel module is imported

from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from speculative_kernels.ops import compaction_triton, lookup_triton, triton_backend  # noqa: E402
from speculative_kernels.ops.eager import plain_eager  # noqa: E402
from speculative_kernels.ops.randomness import Randomness  # noqa: E402
from speculative_kernels.ops.sampling import Sampling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, K, V = 2, 2, 40


def _inputs():
    g = torch.Generator().manual_seed(0)
    target = (torch.randn(B, K + 1, V, generator=g) * 2).to(DEVICE)
    draft = (target[:, :K] + torch.randn(B, K, V, generator=g).to(DEVICE))
    tokens = torch.randint(0, V, (B, K), generator=g).to(DEVICE)
    randomness = Randomness(torch.tensor([3, 4], device=DEVICE), torch.zeros(B, dtype=torch.int64, device=DEVICE),
                            True)
    return target, draft, tokens, randomness


class _Ops(TorchDispatchMode):
    """Records the ops it sees and runs them (an op counter, as benchmarks/op_counts.py)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _torch_library_calls(fn):
    """The set of torch/_library/*.py files whose Python functions ``fn()`` calls."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and f"torch{os.sep}_library" in frame.f_code.co_filename:
            seen.add(os.path.basename(frame.f_code.co_filename))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.fixture
def launches(monkeypatch):
    """Records each kernel launch (kernel name, grid, arguments: tensors as (shape, dtype, strides)) instead of
    running it: the paths are compared by what they launch, without the interpreter's ~0.2 s per launch."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kernel_type = InterpretedFunction if isinstance(triton_backend.stats_kernel, InterpretedFunction) else JITFunction
    record = []

    def describe(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.stride())
        return value

    def run(kernel, *args, grid, warmup, **kwargs):
        record.append((kernel.fn.__name__, tuple(grid), tuple(map(describe, args)),
                       {name: describe(v) for name, v in kwargs.items()}))

    monkeypatch.setattr(kernel_type, "run", run)
    return record


def _case(case):
    """(call, the registered op it stands for, how many op calls, how many kernel launches)."""
    target, draft, tokens, randomness = _inputs()
    if case == "sample":
        logits = target[:, 0].contiguous()
        return (lambda: triton_backend.sample(logits, Sampling(0.8, 5), randomness)), "sample_triton", 1, 8
    if case == "compact_kv":  # one op call per layer tensor
        kv = [torch.randn(B, 2, 6, 4, device=DEVICE) for _ in range(3)]
        mask = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 1]], device=DEVICE)
        return (lambda: compaction_triton.compact_kv(kv, mask)), "compact_kv_triton", 3, 3
    if case == "lookup":
        context = torch.randint(0, 5, (B, 12), device=DEVICE)
        start, end = torch.zeros(B, dtype=torch.int64, device=DEVICE), torch.full((B,), 12, device=DEVICE)
        return (lambda: lookup_triton.prompt_lookup(context, start, end, 3, 2)), "prompt_lookup_triton", 1, 1
    sampling = Sampling(0.0) if case == "greedy" else Sampling(0.8, 5)
    launches = 2 if case == "greedy" else 13  # (top-k: float32 keys, 5 select launches a tensor)
    return (lambda: triton_backend.verify(target, draft, tokens, sampling, randomness)), "verify_triton", 1, launches


@pytest.mark.parametrize("case", ["greedy", "top_k", "sample", "compact_kv", "lookup"])
def test_plain_eager_skips_the_dispatcher_with_the_same_launches(case, launches):
    """A plain eager call reaches no torch/_library code (custom-op layers, ``wrap_triton``); under an op counter the
    same call goes through the registered op, which the counter sees; both launch the same kernels with the same
    grids and arguments (top-k: the radix select's launches too)."""
    call, op, op_calls, launch_count = _case(case)
    assert _torch_library_calls(call) == set()
    fast = launches[:]
    launches.clear()
    with _Ops() as ops:
        call()
    ours = [name for name in ops.names if name.startswith("speculative_kernels.")]
    assert ours == [f"speculative_kernels.{op}.default"] * op_calls
    assert fast == launches
    assert len(fast) == launch_count


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_plain_eager_only_for_plain_calls():
    """The fast path is refused wherever some layer would see the op: modes, function modes (a device context),
    functorch transforms, the autograd profiler, tensor subclasses, inputs that require grad."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.zeros(3)
    assert plain_eager((x, None, 1.0, True))
    with torch.no_grad(), torch.inference_mode():
        assert plain_eager((x,))

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Ops():
        assert not plain_eager((x,))
    with Passthrough():
        assert not plain_eager((x,))
    with torch.device("cpu"):
        assert not plain_eager((x,))
    with torch.autograd.profiler.profile():
        assert not plain_eager((x,))
    assert not plain_eager((x, torch.zeros(3, requires_grad=True)))
    assert not plain_eager((torch.nn.Parameter(torch.zeros(3)),))
    inside = []
    torch.func.vmap(lambda t: inside.append(plain_eager((t,))) or t)(torch.zeros(2, 3))
    torch.jit.trace(lambda t: inside.append(plain_eager((t,))) or t + 1, (x,), check_trace=False)
    assert inside == [False, False]
    fake = FakeTensorMode().from_tensor(x)
    assert not plain_eager((fake,))


def test_plain_eager_is_false_under_torch_compile():
    """Dynamo traces the ops' front ends: ``plain_eager`` must trace (fullgraph) and be False there, so a compiled
    graph holds the registered op (the GPU's compile tests run the ops themselves; the interpreter cannot)."""
    x = torch.zeros(3)
    compiled = torch.compile(lambda t: t + int(plain_eager((t, None, 1.0))), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x)
    assert plain_eager((x, None, 1.0))  # (and True outside)


def test_compaction_and_lookup_give_the_same_results_both_ways():
    """compact_kv and prompt_lookup (the interpreter runs them: a few small programs) through their plain eager path
    and through the registered op (under an op counter) write the same values."""
    kv = torch.randn(B, 1, 6, 4, device=DEVICE)
    mask = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 1]], device=DEVICE)
    fast, registered = kv.clone(), kv.clone()
    compaction_triton.compact_kv([fast], mask)
    with _Ops():
        compaction_triton.compact_kv([registered], mask)
    assert torch.equal(fast, registered) and not torch.equal(fast, kv)
    context = torch.tensor([[1, 2, 3, 1, 2, 4, 1, 2], [5, 6, 5, 6, 5, 6, 7, 5]], device=DEVICE)
    start, end = torch.zeros(B, dtype=torch.int64, device=DEVICE), torch.full((B,), 8, device=DEVICE)
    fast = lookup_triton.prompt_lookup(context, start, end, 3, 2)
    with _Ops():
        registered = lookup_triton.prompt_lookup(context, start, end, 3, 2)
    assert all(torch.equal(a, b) for a, b in zip(fast, registered)) and int(fast[1].sum()) > 0


def test_plan_arithmetic_is_tritons():
    """make_plan's integer helpers (plain arithmetic: Triton's ``constexpr_function``s cost ~3 µs a host call, 20
    calls a plan) agree with ``triton.cdiv`` / ``triton.next_power_of_2``, and a memoised plan is the computed one."""
    import triton

    assert all(triton_backend._next_power_of_2(n) == triton.next_power_of_2(n) for n in range(1, 3000))
    assert all(triton_backend._cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300, 7) for b in range(1, 70))
    tuning = triton_backend.Tuning(num_sms=132)
    for shape in ((1, 5, 128256), (64, 5, 32000), (3, 2, 1001)):
        assert triton_backend.make_plan(*shape, tuning) == triton_backend._plan(*shape, tuning)
