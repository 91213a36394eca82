"""Host time of one eager call of the Triton verification op, split into the kernel launches and the rest.

In eager mode at small batch the Triton op's time is its host time (issue 10). This script times
``triton_backend.verify`` (the registered op ``speculative_kernels::verify_triton`` behind it) per call and splits it:

* ``launch``: time inside Triton's launch entry. On the CPU (``TRITON_INTERPRET=1``) that is
  ``InterpretedFunction.run``, i.e. the interpreted kernels themselves (milliseconds, meaningless for a GPU); on a
  GPU it is ``JITFunction.run``: Triton's own launcher (argument binding, specialization key, cache lookup, launch).
* ``rest``: everything else, i.e. our host path (plan, allocations, cut, argument lists) and torch's custom-op
  machinery (dispatch, autograd layer, ``wrap_triton``): the same Python on the CPU and on a GPU.

Two more rows time the other Triton ops a decoding step may call: ``compact_kv`` of two [B, 8, 64, 64] layer tensors
(one registered op call per tensor) and ``prompt_lookup`` of a [B, 256] context.

Times are the calling thread's CPU time (``time.thread_time``: other processes on a shared machine do not stretch
it). Modes, per configuration (greedy and sampling, with and without draft logits, sampling with a top-k cut):

* timed: ``--calls`` calls with the kernels run; per call total, launch and rest (medians);
* stubbed (interpreter only): the launches replaced by a no-op, so the rest alone is timed over many calls
  (``--stub-calls``; the outputs are garbage, the timing is the host path's);
* profiled: cProfile of the rest alone (on a GPU the profiler is paused inside the launches; in the interpreter the
  launches are stubbed, ``--stub-calls`` calls: the interpreted kernels leave the caches cold for the next call's
  host path): own time per call by layer (torch, triton, ours, C calls) and the top functions. cProfile inflates
  Python time; read it for shares, the timed/stubbed rows for µs.

    TRITON_INTERPRET=1 python benchmarks/triton_host_overhead.py --out DIR      # CPU (~1 minute)
    TRITON_INTERPRET=1 python benchmarks/triton_host_overhead.py --out DIR --stub-only   # CPU, host path only
    python benchmarks/triton_host_overhead.py --out DIR                          # on a GPU (seconds)
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or any kernel module is imported

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parent))  # the package, when it is not installed

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from speculative_kernels.ops import compaction_triton, lookup_triton, triton_backend  # noqa: E402
from speculative_kernels.ops.randomness import Randomness  # noqa: E402
from speculative_kernels.ops.sampling import Sampling  # noqa: E402

LAYERS = ("torch", "triton", "ours", "C calls", "other")
# Host time as the calling thread's CPU time: on a shared machine other processes' load stretches wall time, not this
# (the op does not synchronise with a GPU, so on one its host time is CPU time too; a full launch queue would block).
clock = time.thread_time


class LaunchTimer:
    """Wraps the launch entry (``cls.run``): accumulates the seconds spent inside it, counts the launches, pauses a
    profiler while inside, or (``stub``) skips the launch."""

    def __init__(self, cls):
        self.cls, self.original = cls, cls.run
        self.seconds, self.wall, self.launches, self.profiler, self.stub = 0.0, 0.0, 0, None, False

    def __enter__(self):
        timer = self

        def run(kernel, *args, **kwargs):
            timer.launches += 1
            if timer.stub:
                return None
            if timer.profiler is not None:
                timer.profiler.disable()
            start, start_wall = clock(), time.perf_counter()
            try:
                return timer.original(kernel, *args, **kwargs)
            finally:
                timer.seconds += clock() - start
                timer.wall += time.perf_counter() - start_wall
                if timer.profiler is not None:
                    timer.profiler.enable()

        self.cls.run = run
        return self

    def __exit__(self, *exc):
        self.cls.run = self.original

    def reset(self):
        self.seconds, self.wall, self.launches = 0.0, 0.0, 0


def configurations(args):
    """(name, zero-argument call) per configuration; inputs made once."""
    g = torch.Generator().manual_seed(0)
    batch, k, vocab, device = args.batch, args.k, args.vocab, args.device
    target = (torch.randn(batch, k + 1, vocab, generator=g) * 2).to(device, getattr(torch, args.dtype))
    draft = (target[:, :k].float().cpu() + torch.randn(batch, k, vocab, generator=g)).to(device, target.dtype)
    tokens = torch.randint(0, vocab, (batch, k), generator=g).to(device)
    randomness = Randomness(torch.arange(batch, device=device), torch.zeros(batch, dtype=torch.int64, device=device),
                            True)
    settings = {
        "greedy, draft": (Sampling(0.0), draft),
        "greedy, no draft": (Sampling(0.0), None),
        "sampling, draft": (Sampling(1.0), draft),
        "sampling, no draft": (Sampling(1.0), None),
        f"sampling top_k {args.top_k}, draft": (Sampling(1.0, args.top_k), draft),
    }
    out = [(name, lambda s=s, d=d: triton_backend.verify(target, d, tokens, s, randomness))
           for name, (s, d) in settings.items()]
    # the other Triton ops a decoding step calls: a compaction (one op call per layer tensor) and prompt lookup
    kv = [torch.randn(batch, 8, 64, 64, generator=g).to(device) for _ in range(2)]
    mask = torch.ones(batch, 64, dtype=torch.int64, device=device)
    context = torch.randint(0, 50, (batch, 256), generator=g).to(device)
    start, end = torch.zeros(batch, dtype=torch.int64, device=device), torch.full((batch,), 256, device=device)
    out.append(("compact_kv, 2 tensors", lambda: compaction_triton.compact_kv(kv, mask)))
    out.append(("prompt_lookup", lambda: lookup_triton.prompt_lookup(context, start, end, 10, 2)))
    return out


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(call, timer, calls, device) -> dict:
    """Medians over ``calls`` calls of (total, launch, rest) µs per call."""
    totals, launches = [], []
    for _ in range(calls):
        sync(device)
        timer.reset()
        start = clock()
        call()
        totals.append(clock() - start)  # (host time: no synchronisation inside)
        launches.append(timer.seconds)
    rests = [t - s for t, s in zip(totals, launches)]
    us = (lambda xs: statistics.median(xs) * 1e6)
    return {"total_us": us(totals), "launch_us": us(launches), "rest_us": us(rests), "launches": timer.launches}


def stubbed(call, timer, calls) -> float:
    """µs per call with the launches skipped: the best mean over 7 rounds of ``calls`` calls."""
    timer.stub = True
    try:
        for _ in range(max(10, calls // 10)):
            call()
        best = float("inf")
        for _ in range(7):
            start = clock()
            for _ in range(calls):
                call()
            best = min(best, (clock() - start) / calls)
        return best * 1e6
    finally:
        timer.stub = False


def layer(key) -> str:
    filename, _, function = key
    if filename == "~":
        return "C calls" if "torch" in function else "other"
    for name, part in (("ours", "speculative_kernels"), ("triton", "/triton/"), ("torch", "/torch/")):
        if part in filename:
            return name
    return "other"


def profiled(call, timer, calls, top, stub) -> dict:
    """cProfile of the rest (paused inside the launches; or, ``stub``, with the launches skipped): own µs per call by
    layer, and the top functions."""
    profiler = cProfile.Profile()
    timer.profiler, timer.stub = profiler, stub
    timer.reset()
    start, start_wall = clock(), time.perf_counter()
    profiler.enable()
    try:
        for _ in range(calls):
            call()
    finally:
        profiler.disable()
        timer.profiler, timer.stub = None, False
    cpu = clock() - start - timer.seconds
    wall = time.perf_counter() - start_wall - timer.wall  # (cProfile's own clock)
    stats = pstats.Stats(profiler).stats  # key -> (primitive calls, calls, own s, cumulative s, callers)
    layers = dict.fromkeys(LAYERS, 0.0)
    for key, (_, _, own, _, _) in stats.items():
        layers[layer(key)] += own / calls * 1e6
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return {
        # (own times summing to more than the wall time would mean the profiler counted some time twice)
        "cpu_us": cpu / calls * 1e6,
        "wall_us": wall / calls * 1e6,
        "own_sum_us": sum(layers.values()),
        "layers_us": layers,
        "top": [{"function": f"{Path(f).name}:{line}({name})" if f != "~" else name,
                 "calls": n / calls, "own_us": own / calls * 1e6, "cumulative_us": cum / calls * 1e6}
                for (f, line, name), (_, n, own, cum, _) in rows],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--calls", type=int, default=None, help="timed and profiled calls (default 10 interpreted, 500)")
    p.add_argument("--stub-calls", type=int, default=500)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--only", nargs="*", help="configuration names to run (default all)")
    p.add_argument("--stub-only", action="store_true",
                   help="interpreter: the stubbed and profiled rows only (no interpreted kernels; seconds, for A/B)")
    args = p.parse_args(argv)
    interpreted = isinstance(triton_backend.stats_kernel, InterpretedFunction)
    calls = args.calls or (10 if interpreted else 500)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"torch": torch.__version__, "triton": __import__("triton").__version__, "python": sys.version.split()[0],
              "device": args.device, "interpreted": interpreted, "batch": args.batch, "k": args.k,
              "vocab": args.vocab, "dtype": args.dtype, "calls": calls, "results": {}}
    print(f"{'configuration':32} {'total':>10} {'launch':>10} {'rest':>8} {'stubbed':>8} launches  (µs per call)")
    with LaunchTimer(InterpretedFunction if interpreted else JITFunction) as timer:
        for name, call in configurations(args):
            if args.only and name not in args.only:
                continue
            for _ in range(3):  # compiles, caches
                call()
            if args.stub_only and interpreted:
                timer.reset()
                call()
                row = {"total_us": None, "launch_us": None, "rest_us": None, "launches": timer.launches}
            else:
                row = timed(call, timer, calls, args.device)
            row["stubbed_us"] = stubbed(call, timer, args.stub_calls) if interpreted else None
            row["profile"] = profiled(call, timer, args.stub_calls if interpreted else calls, args.top, interpreted)
            report["results"][name] = row
            cells = [f"{row[k]:{w}.1f}" if row[k] is not None else " " * (w - 1) + "-"
                     for k, w in (("total_us", 10), ("launch_us", 10), ("rest_us", 8), ("stubbed_us", 8))]
            print(f"{name:32} {' '.join(cells)} {row['launches']:3d}")
    for name, row in report["results"].items():
        prof = row["profile"]
        layers = ", ".join(f"{k} {v:.1f}" for k, v in prof["layers_us"].items())
        print(f"\n=== {name}: rest under cProfile {prof['cpu_us']:.1f} µs of CPU per call, {prof['wall_us']:.1f} µs "
              f"wall (own times, wall clock, sum to {prof['own_sum_us']:.1f}): {layers}")
        for r in prof["top"]:
            print(f"  {r['own_us']:8.2f} own {r['cumulative_us']:8.2f} cum {r['calls']:5.1f}x  {r['function']}")
    (args.out / "triton-host-overhead.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
