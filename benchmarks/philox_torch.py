"""The torch reference's Philox4x32-10 (``ops/philox.py``), per call: the split path (16-bit partial products, the
definition), the previous fast path (``wrapping``: one int64 product per word, a round's two words in separate ops;
kept here only for this comparison) and the current one (``stacked``: the same products, a round's two words
stacked in one [2, ...] tensor, in place on rotating buffers).

    OMP_NUM_THREADS=1 python benchmarks/philox_torch.py [--device cpu] [--reps 30]

Each call draws one word per element of a [B, V] race (the draft sampler's and verify's noise); [B, K] with K = 4
is the accept test's uniforms. The three paths are checked bit-identical first; times are medians of interleaved calls
(CPU: process time, one thread). A second table: a race's words with one call per id (the layout before 2026-11-27)
and one call per four ids (``vocabulary_bits``, the layout since).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speculative_kernels.ops import philox  # noqa: E402


def rounds_wrapping(k0, k1, c0, c1, c2, c3) -> torch.Tensor:
    """The previous fast path (replaced by ``philox._rounds_stacked``): the same rounds where an int64 product wraps modulo 2**64 (two's complement, as CPUs and CUDA multiply):
    the product p of two 32-bit words is then exact in its 64 bits, hi = (p >> 32) & mask, lo = p & mask. A third
    of the split path's ops, in place once every word has its broadcast shape (after two rounds)."""
    for r in range(philox.PHILOX_ROUNDS):
        p0 = c0 * philox.PHILOX_M0
        p1 = c2 * philox.PHILOX_M1
        if r < 2:
            c0 = ((p1 >> 32) & philox.MASK32) ^ c1 ^ k0
            c2 = ((p0 >> 32) & philox.MASK32) ^ c3 ^ k1
        else:
            c0 = p1 >> 32
            c0 &= philox.MASK32
            c0 ^= c1
            c0 ^= k0
            c2 = p0 >> 32
            c2 &= philox.MASK32
            c2 ^= c3
            c2 ^= k1
        c1, c3 = p1.bitwise_and_(philox.MASK32), p0.bitwise_and_(philox.MASK32)
        k0 = (k0 + philox.PHILOX_W0) & philox.MASK32
        k1 = (k1 + philox.PHILOX_W1) & philox.MASK32
    return c0



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
    print("| B | V | split µs | wrapping µs | stacked µs | wrapping / stacked |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, vocab in ((1, 4), (1, 4096), (8, 4096), (1, 32000), (1, 128256)):
        seed = torch.randint(-2**63, 2**63 - 1, (batch, 1), generator=g).to(device)
        counters = [torch.arange(vocab).unsqueeze(0), torch.arange(batch).unsqueeze(1),
                    torch.randint(0, 2**32, (batch, 1), generator=g), torch.full((batch, 1), philox.STREAM_DRAFT)]
        counters = [c.to(device) & philox.MASK32 for c in counters]
        k0, k1 = seed & philox.MASK32, (seed >> 32) & philox.MASK32
        paths = {"split": lambda: philox._rounds_split(k0, k1, *torch.broadcast_tensors(*counters)),
                 "wrapping": lambda: rounds_wrapping(k0, k1, *counters),
                 "stacked": lambda: philox._rounds_stacked(k0, k1, *counters)}
        assert torch.equal(paths["split"](), paths["wrapping"]()) and torch.equal(paths["split"](), paths["stacked"]())
        medians = interleaved_medians_us(paths, args.reps, clock, sync)
        split, wrapping, stacked = (medians[name] for name in paths)
        print(f"| {batch} | {vocab} | {split:.0f} | {wrapping:.0f} | {stacked:.0f} | {wrapping / stacked:.2f} |")
    races(args.reps, device, clock, sync, g)
    return 0


def interleaved_medians_us(paths: dict, reps: int, clock, sync) -> dict:
    """Median µs per call of each named callable, the callables alternating call by call (synchronised around each)."""
    times = {name: [] for name in paths}
    for _ in range(reps):
        for name, call in paths.items():
            sync()
            start = clock()
            call()
            sync()
            times[name].append(clock() - start)
    return {name: 1e6 * statistics.median(ts) for name, ts in times.items()}


def races(reps: int, device, clock, sync, g) -> None:
    """A race's words: one call per id, its first word (the layout before 2026-11-27), against one call per four ids
    (``philox.vocabulary_bits``, the layout since), both the stacked path; medians of interleaved calls."""
    print()
    print("| B | V | one call per id µs | one call per 4 ids µs | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for batch, vocab in ((1, 4096), (8, 4096), (1, 32000), (1, 128256)):
        seed = torch.randint(-2**63, 2**63 - 1, (batch, 1), generator=g).to(device)
        c1, c2 = torch.arange(batch).unsqueeze(1).to(device), torch.randint(0, 2**32, (batch, 1), generator=g).to(device)
        c3 = torch.full((batch, 1), philox.STREAM_DRAFT, device=device)
        ids = torch.arange(vocab, device=device).unsqueeze(0)
        paths = {"per id": lambda: philox.philox_first_word(seed, ids, c1, c2, c3),
                 "per 4 ids": lambda: philox.vocabulary_bits(seed, vocab, c1, c2, c3)}
        medians = interleaved_medians_us(paths, reps, clock, sync)
        one, four = (medians[name] for name in paths)
        print(f"| {batch} | {vocab} | {one:.0f} | {four:.0f} | {one / four:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
