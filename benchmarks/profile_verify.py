"""Where the verification op's time goes: the questions the second GPU run left open (benchmarks/RESULTS.md).

1. Device side, per kernel (run under Nsight Compute): is the sampling path bound by memory or by arithmetic?
   ``--ncu`` re-runs this script under ``ncu`` with a few metrics per kernel (duration, DRAM and SM throughput as a
   share of peak, instructions executed, registers, achieved occupancy) and writes its CSV to ``--out``.
2. Host side, eager: what the Triton backend's ~250 µs per call at B=1 (against 5 µs of its kernels replayed in a
   CUDA graph) is spent on. ``cProfile`` over many eager calls, the top functions by own time.

    python benchmarks/profile_verify.py --out DIR            # both, on the GPU (about a minute)
    python benchmarks/profile_verify.py --out DIR --device cpu --vocab 1000   # CPU smoke test (no ncu)

Inputs as ``bench_verify.py`` (K=4, V=128256, bf16 by default; B 1 and 64; greedy and sampling; backends cuda and
triton where they run).
"""

import argparse
import cProfile
import io
import json
import pstats
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the package, when it is not installed
from bench_verify import load_backend, make_inputs  # noqa: E402

from speculative_kernels.ops.randomness import Randomness  # noqa: E402
from speculative_kernels.ops.sampling import Sampling  # noqa: E402

KERNELS = "stats|race|finish|decide|finalize|single_pass"  # the op's kernels (Triton and CUDA), not the inputs' setup
NCU_METRICS = ",".join([
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__inst_executed.sum",
    "launch__registers_per_thread",
    "launch__grid_size",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
])


def calls(args):
    """(name, zero-argument call) per configuration, inputs made once."""
    out = []
    for backend in args.backends:
        verify, why = load_backend(backend, args.device)
        if verify is None:
            print(f"{backend}: skipped ({why})")
            continue
        for mode in ("greedy", "sampling"):
            for batch in args.batch:
                target, draft, tokens, seeds, offsets = make_inputs(batch, args.k, args.vocab, mode,
                                                                    getattr(torch, args.dtype), args.device, seed=0)
                sampling = Sampling(0.0 if mode == "greedy" else 1.0)
                randomness = Randomness(seeds, offsets, True)
                out.append((f"{backend} {mode} B={batch}",
                            lambda v=verify, t=target, d=draft, x=tokens, s=sampling, r=randomness: v(t, d, x, s, r)))
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_profile(args, configs) -> dict:
    """cProfile of ``--calls`` eager calls per configuration: the top functions by own time, and the mean wall time
    per call (host-bound calls: close to their eager time)."""
    import time

    report = {}
    for name, call in configs:
        for _ in range(5):  # compiles, caches
            call()
        sync(args.device)
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(args.calls):
            call()
        profiler.disable()
        sync(args.device)
        per_call_us = (time.perf_counter() - start) / args.calls * 1e6
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        report[name] = {"us_per_call_profiled": per_call_us, "top": text.getvalue()}
        print(f"\n=== {name}: {per_call_us:.1f} us per call under cProfile ===\n{text.getvalue()}")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", nargs="+", default=["cuda", "triton"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--calls", type=int, default=200, help="eager calls profiled per configuration")
    p.add_argument("--ncu", action="store_true", help="re-run under ncu for the per-kernel metrics")
    p.add_argument("--kernels-only", action="store_true", help=argparse.SUPPRESS)  # the run ncu profiles
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    configs = calls(args)
    if args.kernels_only:  # under ncu: each configuration's kernels, a few times
        for _, call in configs:
            for _ in range(3):
                call()
        sync(args.device)
        return 0
    (args.out / "host-profile.json").write_text(json.dumps(host_profile(args, configs), indent=1))
    if args.ncu:
        if shutil.which("ncu") is None:
            print("ncu is not on the PATH: no per-kernel metrics")
            return 0
        argv_here = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--ncu"]
        cmd = ["ncu", "--csv", "--metrics", NCU_METRICS, "--clock-control", "none", "--kernel-name",
               f"regex:{KERNELS}", sys.executable, __file__, *argv_here, "--kernels-only"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        (args.out / "ncu.csv").write_text(result.stdout)
        (args.out / "ncu.err").write_text(result.stderr)
        print(f"ncu: rc {result.returncode}, {len(result.stdout.splitlines())} lines in {args.out / 'ncu.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
