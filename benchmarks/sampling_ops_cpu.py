"""The CPU sampling path's own cost per decode iteration: the torch backend's draft sampler (one call per draft
token) and verification (one per iteration), per call, at the shapes of the demo pair's sampled runs.

    OMP_NUM_THREADS=1 python benchmarks/sampling_ops_cpu.py [--baseline DIR] [--reps 200] [--json PATH]

``--baseline DIR``: a checkout of another commit (``git worktree add DIR <commit>``); its ``speculative_kernels`` is
imported into the same process under its own module objects, and each case's calls alternate between the two
(a paired A/B: same inputs, same load). Both versions' outputs are checked equal first (same random streams), unless
``--streams-differ`` says the baseline draws other numbers (a change of the counter layout).
Times: process CPU time of one call, median over ``--reps`` interleaved calls, one thread. An iteration at gamma
K is K sampler calls and one verification: ``iteration µs`` = K * sample + verify.
"""

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# (B, K, V, temperature, top_k, top_p): the demo pair's e2e runs (V = 4096, T = 0.8, no cuts), the op-count
# benchmark's warping (top-k 50, top-p 0.95), and a Llama-2-sized vocabulary.
# With top-k and top-p at Llama's vocabularies: the cut's cost grows with V (a V-length sort before the topk of k).
CASES = [(1, 4, 4096, 0.8, 0, 1.0), (1, 4, 4096, 0.8, 50, 0.95), (4, 4, 4096, 0.8, 0, 1.0), (1, 4, 32000, 0.8, 0, 1.0),
         (1, 4, 32000, 0.8, 50, 0.95), (1, 4, 128256, 0.8, 50, 0.9), (4, 4, 32000, 0.8, 50, 0.9)]


def load_package(path: Path) -> dict:
    """Import ``speculative_kernels`` from ``path`` and return the entry points this benchmark calls; the modules are
    then dropped from ``sys.modules`` so that another checkout can be imported beside them."""
    for name in [n for n in sys.modules if n == "speculative_kernels" or n.startswith("speculative_kernels.")]:
        del sys.modules[name]
    sys.path.insert(0, str(path))
    try:
        backend = importlib.import_module("speculative_kernels.ops.torch_backend")
        sampling = importlib.import_module("speculative_kernels.ops.sampling")
        randomness = importlib.import_module("speculative_kernels.ops.randomness")
    finally:
        sys.path.remove(str(path))
    for name in [n for n in sys.modules if n == "speculative_kernels" or n.startswith("speculative_kernels.")]:
        del sys.modules[name]
    return {"sample": backend.sample, "verify": backend.verify, "Sampling": sampling.Sampling,
            "DecodeRandomness": randomness.DecodeRandomness, "path": str(path)}


def calls(package: dict, case, inputs):
    """(sample, verify) closures of one package on one case's inputs, at fixed offsets (the same numbers per rep)."""
    batch, k, vocab, temperature, top_k, top_p = case
    target, draft, tokens = inputs
    sampling = package["Sampling"](temperature, top_k, top_p)
    randomness = package["DecodeRandomness"](batch, torch.device("cpu"), seed=1234)
    return (lambda: package["sample"](draft[:, 0], sampling, randomness.draft()),
            lambda: package["verify"](target, draft, tokens, sampling, randomness.verify()))


def make_inputs(case, seed: int = 0):
    batch, k, vocab = case[:3]
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=g) * 3
    draft = target[:, :k] + torch.randn(batch, k, vocab, generator=g)
    tokens = torch.multinomial(torch.softmax(draft.reshape(-1, vocab), -1), 1, generator=g).reshape(batch, k)
    return target, draft, tokens


def time_interleaved(fns: dict, reps: int) -> dict:
    """Median process-time µs per call of each named callable, the callables alternating call by call."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    return {name: 1e6 * statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of the commit to compare with (same process)")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--streams-differ", action="store_true",
                        help="the baseline draws other random numbers (a change of the counter layout): its outputs "
                             "are not compared with this checkout's")
    parser.add_argument("--cases", type=int, nargs="+", help="indices into CASES (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    packages = {"this": load_package(ROOT)}
    if args.baseline is not None:
        packages["baseline"] = load_package(args.baseline.resolve())
    rows = []
    print("| B | K | V | top-k | top-p | version | sample µs | verify µs | iteration µs (K sample + verify) |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for case in [CASES[i] for i in args.cases] if args.cases else CASES:
        inputs = make_inputs(case)
        fns = {}
        for name, package in packages.items():
            sample, verify = calls(package, case, inputs)
            fns[(name, "sample")], fns[(name, "verify")] = sample, verify
        if "baseline" in packages and not args.streams_differ:  # the same random streams: identical outputs
            assert torch.equal(fns[("this", "sample")](), fns[("baseline", "sample")]())
            assert all(torch.equal(a, b) for a, b in zip(fns[("this", "verify")](), fns[("baseline", "verify")]()))
        us = time_interleaved(fns, args.reps)
        batch, k, vocab, temperature, top_k, top_p = case
        for name in packages:
            iteration = k * us[(name, "sample")] + us[(name, "verify")]
            rows.append(dict(batch=batch, k=k, vocab=vocab, temperature=temperature, top_k=top_k, top_p=top_p,
                             version=name, sample_us=us[(name, "sample")], verify_us=us[(name, "verify")],
                             iteration_us=iteration))
            print(f"| {batch} | {k} | {vocab} | {top_k} | {top_p} | {name} | {us[(name, 'sample')]:.0f} | "
                  f"{us[(name, 'verify')]:.0f} | {iteration:.0f} |")
        if "baseline" in packages:
            ratio = rows[-1]["iteration_us"] / rows[-2]["iteration_us"]
            print(f"|  |  |  |  |  | baseline / this |  |  | {ratio:.2f} |")
    if args.json:
        meta = dict(machine=platform.processor() or platform.machine(), python=platform.python_version(),
                    torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    command=" ".join(sys.argv), packages={n: p["path"] for n, p in packages.items()})
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
