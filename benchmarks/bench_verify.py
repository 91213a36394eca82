"""Benchmark of the verification op: every backend side by side on the same inputs, in one run.

    python benchmarks/bench_verify.py                      # full sweep on the GPU (eager, do_bench median)
    python benchmarks/bench_verify.py --quick --cuda-graph  # small sweep, launch overhead removed
    python benchmarks/bench_verify.py --cold-l2 --cuda-graph  # rotate input sets so L2 never holds them
    python benchmarks/bench_verify.py --device cpu --backends torch  # CPU smoke test (tiny sizes)

Backends: ``cuda`` (csrc extension), ``triton``, ``torch`` (the reference, ``reference.verify_reference``) and
``torch-compile`` (``torch.compile(fullgraph=True)`` of the reference); on request ``cuda-split`` / ``cuda-fused``
(the CUDA kernels with their split or fused sampling passes at every batch size: ``--backends cuda-split cuda-fused
torch --modes sampling`` compares them) and ``cuda-single`` (every pass in one kernel after a memset, greedy and
sampling, bf16 logits without a cut: ``SPECULATIVE_KERNELS_VERIFY_PASSES=single``, not the default until measured). An unavailable backend is skipped with the reason printed. Reports µs/call, effective GB/s against the bytes the op must read (sampling: target + draft logits,
(2K+1)·V·2 per batch row in bf16; greedy with ``draft_logits=None``: (K+1)·V·2) and the speed-up over the torch
reference; prints a markdown table and writes CSV, JSON and a plot of µs vs batch size to ``--out``.
"""

import argparse
import functools
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the package, when it is not installed
from harness import environment, markdown_table, plot_vs_batch, rotate, save, time_us  # noqa: E402

from speculative_kernels.ops import backends  # noqa: E402
from speculative_kernels.ops.randomness import Randomness  # noqa: E402
from speculative_kernels.ops.reference import verify_reference  # noqa: E402
from speculative_kernels.ops.sampling import Sampling  # noqa: E402

ALL_BACKENDS = ("cuda", "triton", "torch", "torch-compile")
# The CUDA kernels with one pass structure at every batch size (``cuda`` picks by batch size: fused at B = 1 and while
# B x V <= 131072; ``cuda-single``: one kernel, not picked by default).
PASS_VARIANTS = ("cuda-split", "cuda-fused", "cuda-single")
FULL = dict(batch=[1, 4, 16, 64, 256], k=[1, 4, 8], vocab=[32000, 128256, 151936])
QUICK = dict(batch=[1, 16, 64], k=[4], vocab=[32000, 128256])
CPU = dict(batch=[1, 4], k=[1, 4], vocab=[1000])
L2_BYTES = 50 * 2**20  # H100; rotation aims at twice this


def load_backend(name: str, device: str):
    """The ``verify`` callable of a backend, or the reason it cannot run."""
    if name == "torch":
        return verify_reference, None
    if name == "torch-compile":
        return torch.compile(verify_reference, fullgraph=True, dynamic=False), None
    if name in PASS_VARIANTS:
        verify, reason = load_backend("cuda", device)
        return (None, reason) if verify is None else (with_passes(name.removeprefix("cuda-"), verify), None)
    try:
        return backends.implementation(name, device).verify, None
    except (RuntimeError, ImportError, OSError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def with_passes(passes: str, verify):
    """``verify`` run with SPECULATIVE_KERNELS_VERIFY_PASSES=passes (read by the CUDA launcher at each launch, so
    also while a CUDA graph captures)."""
    @functools.wraps(verify)
    def run(*args, **kwargs):
        previous = os.environ.get("SPECULATIVE_KERNELS_VERIFY_PASSES")
        os.environ["SPECULATIVE_KERNELS_VERIFY_PASSES"] = passes
        try:
            return verify(*args, **kwargs)
        finally:
            if previous is None:
                os.environ.pop("SPECULATIVE_KERNELS_VERIFY_PASSES")
            else:
                os.environ["SPECULATIVE_KERNELS_VERIFY_PASSES"] = previous
    return run


def triton_variant(spec: str, device: str):
    """``verify`` of the Triton backend with launch knobs from ``"block_v=1024,num_warps=4"`` (tuning sweeps)."""
    import dataclasses

    from speculative_kernels.ops import triton_backend

    base = triton_backend.default_tuning(torch.device(device))
    tuning = dataclasses.replace(base, **{k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))})
    return functools.partial(triton_backend.launch_verify, tuning=tuning)


def make_inputs(batch, k, vocab, mode, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    target = (torch.randn(batch, k + 1, vocab, generator=g, device=device) * 2).to(dtype)
    draft = None
    if mode == "sampling":
        draft = (target[:, :k].float() + torch.randn(batch, k, vocab, generator=g, device=device)).to(dtype)
    tokens = torch.randint(0, vocab, (batch, k), generator=g, device=device)
    seeds = torch.arange(batch, dtype=torch.int64, device=device) + seed
    offsets = torch.zeros(batch, dtype=torch.int64, device=device)
    return target, draft, tokens, seeds, offsets


def bytes_read(batch, k, vocab, mode, itemsize) -> int:
    rows = 2 * k + 1 if mode == "sampling" else k + 1
    return batch * rows * vocab * itemsize


def compiled_here(args, name, k, vocab) -> bool:
    """torch-compile compiles once per shape: ``--compile-k`` / ``--compile-vocab`` limit it to some configs."""
    if name != "torch-compile":
        return True
    return (args.compile_k is None or k in args.compile_k) and (args.compile_vocab is None or vocab in args.compile_vocab)


def bench_config(args, fns, batch, k, vocab, mode, timing) -> list[dict]:
    """One row per backend for one (mode, B, K, V) and one timing ("eager" or "graph": CUDA-graph replays)."""
    dtype = getattr(torch, args.dtype)
    nbytes = bytes_read(batch, k, vocab, mode, torch.finfo(dtype).bits // 8)
    sets = max(2, min(args.max_sets, math.ceil(2 * L2_BYTES / nbytes))) if args.cold_l2 else 1
    inputs = [make_inputs(batch, k, vocab, mode, dtype, args.device, seed) for seed in range(sets)]
    temperature = 1.0 if mode == "sampling" else 0.0
    rows = []
    for name, fn in fns.items():
        if not compiled_here(args, name, k, vocab):
            continue
        sampling = Sampling(temperature, args.top_k, args.top_p)
        calls = [functools.partial(fn, t, d, x, sampling, Randomness(s, o, True)) for t, d, x, s, o in inputs]
        row = dict(backend=name, timing=timing, mode=mode, batch=batch, k=k, vocab=vocab, sets=sets)
        try:
            us = time_us(rotate(calls), args.device, cuda_graph=timing == "graph", rep_ms=args.rep_ms)
            row.update(us=us, gbps=nbytes / us / 1e3)
        except Exception as exc:  # a backend that cannot be timed here (e.g. not capturable) is reported, not fatal
            print(f"  {name} {timing} {mode} B={batch} K={k} V={vocab}: failed: {type(exc).__name__}: {exc}")
            row.update(us=None, gbps=None, error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    base = next((r["us"] for r in rows if r["backend"] == "torch" and r["us"]), None)
    for r in rows:
        r["speedup_vs_torch"] = base / r["us"] if base and r["us"] else None
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--backends", nargs="+", default=list(ALL_BACKENDS), choices=ALL_BACKENDS + PASS_VARIANTS)
    p.add_argument("--modes", nargs="+", default=["greedy", "sampling"], choices=["greedy", "sampling"])
    p.add_argument("--batch", type=int, nargs="+")
    p.add_argument("--k", type=int, nargs="+")
    p.add_argument("--vocab", type=int, nargs="+")
    p.add_argument("--triton-tuning", nargs="*", default=[], metavar="K=V,...",
                   help="extra Triton variants with these Tuning fields, e.g. block_v=1024,num_warps=4")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="small sweep")
    p.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays only (no launch overhead)")
    p.add_argument("--timings", nargs="+", choices=["eager", "graph"],
                   help="eager launches and/or CUDA-graph replays, in one run (default: eager, or graph with "
                        "--cuda-graph)")
    p.add_argument("--compile-k", type=int, nargs="+", help="time torch-compile only at these K (it compiles per "
                   "shape)")
    p.add_argument("--compile-vocab", type=int, nargs="+", help="time torch-compile only at these V")
    p.add_argument("--cold-l2", action="store_true", help="rotate input sets so that L2 never holds the inputs")
    p.add_argument("--rep-ms", type=float, default=100, help="GPU: milliseconds of timed repeats per measurement")
    p.add_argument("--max-sets", type=int, default=16, help="cap on rotated input sets")
    p.add_argument("--max-gb", type=float, default=4.0, help="skip configs whose logits exceed this many GB")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    sweep = CPU if args.device == "cpu" else QUICK if args.quick else FULL
    for key in ("batch", "k", "vocab"):
        if getattr(args, key) is None:
            setattr(args, key, sweep[key])
    if args.timings is None:
        args.timings = ["graph"] if args.cuda_graph else ["eager"]
    if args.device == "cpu" and "graph" in args.timings:
        p.error("CUDA-graph timing (--cuda-graph, --timings graph) needs --device cuda")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch._dynamo.config.cache_size_limit = 256  # one compiled graph per shape for torch-compile
    fns = {}
    for name in args.backends:
        fn, reason = load_backend(name, args.device)
        if fn is None:
            print(f"skipping backend {name!r}: {reason}")
        else:
            fns[name] = fn
    if args.triton_tuning and "triton" in fns:
        for spec in args.triton_tuning:
            fns[f"triton[{spec}]"] = triton_variant(spec, args.device)
    meta = environment(args.device)
    meta.update(dtype=args.dtype, timings=args.timings, cold_l2=args.cold_l2, top_k=args.top_k, top_p=args.top_p)
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    rows = []
    columns = ["backend", "timing", "mode", "batch", "k", "vocab", "us", "gbps", "speedup_vs_torch"]
    for timing in args.timings:
        for mode in args.modes:
            for vocab in args.vocab:
                for k in args.k:
                    for batch in args.batch:
                        if bytes_read(batch, k, vocab, "sampling", 4) > args.max_gb * 1e9:
                            print(f"  skip B={batch} K={k} V={vocab}: over --max-gb")
                            continue
                        new = bench_config(args, fns, batch, k, vocab, mode, timing)
                        rows += new
                        print(markdown_table(new, columns).split("\n", 2)[-1], flush=True)
    print("\n" + markdown_table(rows, columns))
    stamp = meta["date"].replace(":", "").replace("-", "")
    suffix = "".join(f"-{t}" for t in args.timings) + ("-coldl2" if args.cold_l2 else "")
    stem = args.out / f"verify-{args.device}{suffix}-{stamp}"
    written = save(rows, meta, stem)
    plot = plot_vs_batch(rows, stem.with_suffix(".png"), panel_keys=["timing", "mode", "k", "vocab"])
    print("wrote", ", ".join(str(p) for p in written + ([plot] if plot else [])))
    return rows


if __name__ == "__main__":
    main()
