"""The torch reference's Philox4x32-10 (``ops/philox.py``): the split path (16-bit partial products, the
definition) against the wrapping path (one int64 product per word, used where products wrap), per call.

    OMP_NUM_THREADS=1 python benchmarks/philox_torch.py [--device cpu] [--reps 30]

Each call draws one word per element of a [B, V] race (the draft sampler's and verify's noise). Both paths are
checked bit-identical first; times are medians of interleaved calls (CPU: process time, one thread).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speculative_kernels.ops import philox  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    print("| B | V | split µs | wrapping µs | split / wrapping |")
    print("|---:|---:|---:|---:|---:|")
    for batch, vocab in ((1, 4096), (8, 4096), (1, 32000), (1, 128256)):
        seed = torch.randint(-2**63, 2**63 - 1, (batch, 1), generator=g).to(device)
        counters = [torch.arange(vocab).unsqueeze(0), torch.arange(batch).unsqueeze(1),
                    torch.randint(0, 2**32, (batch, 1), generator=g), torch.full((batch, 1), philox.STREAM_DRAFT)]
        counters = [c.to(device) & philox.MASK32 for c in counters]
        k0, k1 = seed & philox.MASK32, (seed >> 32) & philox.MASK32
        paths = {"split": lambda: philox._rounds_split(k0, k1, *torch.broadcast_tensors(*counters)),
                 "wrapping": lambda: philox._rounds_wrapping(k0, k1, *counters)}
        assert torch.equal(paths["split"](), paths["wrapping"]())
        times = {name: [] for name in paths}
        for _ in range(args.reps):
            for name, call in paths.items():
                sync()
                start = clock()
                call()
                sync()
                times[name].append(clock() - start)
        split, wrapping = (1e6 * statistics.median(times[name]) for name in paths)
        print(f"| {batch} | {vocab} | {split:.0f} | {wrapping:.0f} | {split / wrapping:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
