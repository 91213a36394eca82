"""Does Inductor's Triton code for the torch backend's ops compile? A check that needs no GPU.

On CUDA, ``torch.compile`` of ``ops.verify`` / ``ops.sample`` with ``backend="torch"`` lowers the plain-PyTorch ops
(the Philox rounds among them) to Triton kernels written by Inductor. Those kernels can fail in Triton's front end:
the seventh GPU run (2026-11-28, torch 2.11) found ``2654435769*x1`` (a Philox round-key constant times an index)
refused as "Scalar 2654435769 is out of range for type int32". This script reproduces that class of failure on a
CPU-only machine: Inductor's Triton CPU backend writes the same kernels (device-independent lowering), and each kernel
is put through Triton's front end and compiled for an sm_90 target (``triton.compile`` with a ``GPUTarget``, as
``speculative_kernels.ops.triton_aot`` does). Nothing runs; compiled results are compared with eager only on a GPU
(``tests/ops/test_ops_compile.py``).

    python benchmarks/inductor_triton_check.py          # ~3 minutes on 2 cores; exit status 1 if a kernel fails
"""

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ops"))

_DECORATORS = ("pointwise", "reduction", "persistent_reduction", "split_scan", "foreach", "cooperative_reduction",
               "template")


def _install_recorder(sources: list) -> None:
    """Inductor on the CPU with its Triton backend; kernels recorded (their source) instead of compiled."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton

    inductor_config.cpu_backend = "triton"
    inductor_config.compile_threads = 1
    torch_triton.triton_hash_with_backend = lambda: "no-driver"  # (there is no Triton driver on a CPU-only machine)
    torch_triton.triton_backend = lambda: None

    def record(self, kernel_name, source_code, device_str="cuda"):
        sources.append((kernel_name, source_code))
        return object()  # (the compiled module fails when run: only its kernels' sources are wanted)

    async_compile.AsyncCompile.triton = record


def front_end(name: str, source: str, workdir: Path) -> None:
    """Compile one Inductor kernel module's kernel for sm_90 (raises the front end's error)."""
    import torch._inductor.runtime.triton_heuristics as heuristics
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    saved = {kind: getattr(heuristics, kind) for kind in _DECORATORS if hasattr(heuristics, kind)}
    for kind in saved:  # the heuristics decorators hand back (the jit function, its Triton metadata)
        setattr(heuristics, kind, lambda *args, **kwargs: (lambda fn: (fn, kwargs)))
    try:
        path = workdir / f"{name}.py"
        path.write_text(source)
        module = types.ModuleType(name)
        module.__dict__["__file__"] = str(path)
        exec(compile(source, str(path), "exec"), module.__dict__)
    finally:
        for kind, decorator in saved.items():
            setattr(heuristics, kind, decorator)
    fn, kwargs = module.__dict__[name]
    meta = kwargs["triton_meta"]
    signature = dict(meta["signature"])
    constants = dict(meta.get("constants", {}))
    for arg in fn.arg_names:  # block sizes: any power of two exercises the front end
        if signature.get(arg) == "constexpr" and arg not in constants:
            constants[arg] = 1 if arg.startswith("R") else 64
    constants = {(fn.arg_names.index(k),) if isinstance(k, str) else k: v for k, v in constants.items()}
    triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32))


def cases():
    """(name, function, args): the steps of ``tests/ops/test_ops_compile.py`` with ``backend="torch"``, bf16."""
    from test_ops_compile import WARPS, _inputs

    from speculative_kernels import ops

    def scalar_case(warp):
        temperature, top_k, top_p = warp

        def step(t, d, x, s, o):
            kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, offset=o, backend="torch")
            return (*ops.verify(t, d, x, **kw), *ops.verify(t, None, x, **kw), ops.sample(t[:, 0], **kw))

        target, draft, tokens = _inputs(3, 4, 1000, "cpu", torch.bfloat16)
        return step, (target, draft, tokens, torch.tensor([5, 6, 7]), torch.tensor([1, 1, 2]))

    def per_row_case():
        def step(t, d, x, s, o, limit, temperature, top_k, top_p):
            kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, offset=o, backend="torch")
            return (*ops.verify(t, d, x, num_draft_tokens=limit, **kw),
                    *ops.verify(t, None, x, num_draft_tokens=limit, **kw), ops.sample(t[:, 0], **kw))

        target, draft, tokens = _inputs(4, 3, 1000, "cpu", torch.bfloat16)
        return step, (target, draft, tokens, torch.tensor([5, 6, 7, 8]), torch.tensor([1, 1, 2, 0]),
                      torch.tensor([3, 0, 2, 1]), torch.tensor([0.0, 0.7, 1.0, 1.3]), torch.tensor([0, 20, 0, 5]),
                      torch.tensor([1.0, 0.9, 0.8, 1.0], dtype=torch.float64))

    for name, warp in zip(("greedy", "plain", "topk-topp"), WARPS):
        yield (name, *scalar_case(warp))
    yield ("per-row", *per_row_case())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/inductor_triton_check"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    sources: list = []
    _install_recorder(sources)
    failures = 0
    for name, step, inputs in cases():
        torch._dynamo.reset()
        sources.clear()
        try:
            torch.compile(step, fullgraph=True)(*inputs)
        except Exception:  # (the recorded module cannot run; a failure before any kernel is a real one)
            if not sources:
                raise
        bad = []
        for kernel, source in sources:
            try:
                front_end(kernel, source, args.workdir)
            except Exception as error:  # noqa: BLE001 (reported per kernel)
                bad.append((kernel, [line for line in str(error).splitlines() if line.strip()][-1][:300]))
        failures += len(bad)
        print(f"{name}: {len(sources)} kernels, {len(bad)} failed" + "".join(f"\n  {k}: {e}" for k, e in bad),
              flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
