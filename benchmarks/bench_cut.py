"""Benchmark of the top-k cut, alone and with top-p (what a sampling verification computes before its kernels),
variants side by side.

    python benchmarks/bench_cut.py                 # GPU: B 1 8 64 256, K 4, V 32000 128256, bf16, k 50, top_p 1 0.9,
                                                   # CUDA graph
    python benchmarks/bench_cut.py --dry-run       # CPU, toy sizes (checks the variants agree; timings meaningless)

One call = the cut of the target's [B, K+1, V] and the draft's [B, K, V] logits, as ``verify`` computes both.
Variants with top-k alone (``--top-p 1``):

* ``element``: ``cuda_host._element_cut`` (the path before the fast one: float32 z, topk over z, an element of that
  value: ~7 passes besides the topk);
* ``raw-topk``: ``cuda_host._top_k_cut`` with ``warping.kth_largest_index`` (one torch.topk over the raw logits, their
  own dtype: the CUDA backend's path before the radix select);
* ``radix`` (GPU, with the CUDA extension): ``cuda_host._top_k_cut`` as the CUDA backend runs it, with
  ``torch.ops.speculative_kernels_cuda.kth_largest_index`` (``csrc/topk_kernels.cu``: a multi-block radix select, a
  memset and 2 kernels per call for bf16/fp16, 4 for float32);
* ``two-stage[C]``: topk k of each chunk of C ids ([rows * V/C, C]), then topk k over the rows' k * V/C candidates (the
  k largest values of a row are among its chunks' k largest, so the k-th value is the same; C divides V);
* ``triton-element`` / ``triton-z-gather`` / ``triton-raw`` (GPU, or the CPU under TRITON_INTERPRET=1): the Triton
  backend's cut: ``_scaled`` then ``warp_thresholds``; a topk over the raw logits and the value gathered from the
  whole z (``_scaled``: the path before ``_cuts`` dropped its copy of z); ``triton_backend._cuts`` (the radix select
  of ``triton_select.py``, z of its element only; before 2026-11-28 a torch.topk over the raw logits).

Variants with top-k and top-p (``--top-p`` < 1; ``warping.py``: top-p after top-k):

* ``sort``: the cut's whole-vocabulary definition (``warping._top_p_after_top_k_cut``: float32 z, a V-length stable
  sort, weights and a cumulative sum over V), the cost class of the path before the topk of k;
* ``topk-k``: ``cuda_host._top_k_top_p_cut`` (float32 z, a topk of k, the tie count over V);
* ``rows-sort`` / ``rows-topk-bound``: ``warping.row_thresholds`` with per-row tensors (every row k, top_p): one
  V-length sort per row, against one topk of a host bound (2k; ``top_k_bound``, as serving passes it);
* ``triton-sort`` / ``triton-z-topk-k`` (GPU, or TRITON_INTERPRET=1): the same two from the Triton backend's z
  (``_scaled``: a float32 copy of z); ``triton-topk-k``: ``triton_backend._cuts`` (a topk over the raw logits, z of
  the k candidates, the ties counted by ``warping.scaled_equal``: no copy of z); ``triton-rows-z-bound`` /
  ``triton-rows-bound``: per-row tensors with a host bound of 2k, from the Triton z (``_scaled``) or without a copy
  of z (``_cuts``: ``warping.rows_top_k_cut_of_logits``).

Every variant's sources are checked to give the same z (z = float32(x) / T, bit for bit) as ``element``'s (with
top-p: the same z and the same cut index as ``sort``'s) before it is timed; a mismatch stops the run. GPU timing:
``harness.time_us`` with ``cuda_graph`` (CUDA events around replays of a captured graph of many calls, median), input
sets rotated so L2 never holds them (as ``bench_verify --cold-l2``).
Writes JSON and CSV to ``--out``.
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
from harness import environment, markdown_table, rotate, save, time_us  # noqa: E402

from speculative_kernels.ops import warping  # noqa: E402
from speculative_kernels.ops.cuda_host import _element_cut, _top_k_cut, _top_k_top_p_cut  # noqa: E402
from speculative_kernels.ops.sampling import Sampling  # noqa: E402

L2_BYTES = 50 * 2**20  # H100's; the rotated sets total at least twice this


def two_stage_top_k_cut(logits: torch.Tensor, top_k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_top_k_cut`` by two topk passes: per chunk of ``chunk`` ids (a divisor of V, >= top_k), then over the
    candidates. logits [..., V] -> (source [...] int32, index [...] int32 zeros)."""
    *lead, vocab = logits.shape
    chunks = vocab // chunk
    values, ids = torch.topk(logits.reshape(-1, chunks, chunk), top_k, dim=-1)  # [R, chunks, k]
    ids = ids + (torch.arange(chunks, device=logits.device) * chunk).view(1, chunks, 1)
    best = torch.topk(values.reshape(-1, chunks * top_k), top_k, dim=-1).indices[:, -1:]  # [R, 1]
    source = ids.reshape(-1, chunks * top_k).gather(-1, best).view(lead)
    return source.to(torch.int32), torch.zeros_like(source, dtype=torch.int32)


def sorted_cut(z: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-vocabulary top-p-after-top-k cut of z [..., V] float32: (value, index) [...] (a V-length sort)."""
    sorted_z, order = torch.sort(z, dim=-1, stable=True)
    kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
    return warping._top_p_after_top_k_cut(sorted_z, order, kth, warping._float32(1.0 - top_p))


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = float32(x) / T, a true division by a device scalar (as ``cuda_host`` and the kernels)."""
    return logits.to(torch.float32) / torch.full((), temperature, device=logits.device)


def chunk_near(vocab: int, target: int, top_k: int) -> int | None:
    """The divisor of ``vocab`` nearest ``target`` with at least ``top_k`` ids and at least two chunks, or None."""
    divisors = [d for d in range(top_k, vocab // 2 + 1) if vocab % d == 0]
    return min(divisors, key=lambda d: (abs(math.log(d / target)), d)) if divisors else None


def source_z(logits: torch.Tensor, source: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32(x[source]) / T as int32 bits (a true division, as the kernels')."""
    x = logits.gather(-1, source.to(torch.int64).unsqueeze(-1)).squeeze(-1).float()
    return (x / torch.full((), temperature, device=x.device)).view(torch.int32)


def cuda_select(args):
    """The CUDA backend's k-th largest select (``torch.ops.speculative_kernels_cuda.kth_largest_index``) on a CUDA
    device where the extension loads; None elsewhere (the reason printed)."""
    if args.device != "cuda":
        return None
    from speculative_kernels.ops import cuda_ext

    reason = cuda_ext.unavailable_reason()
    if reason is not None:
        print(f"skipping the radix variant: {reason}")
        return None
    return torch.ops.speculative_kernels_cuda.kth_largest_index


def triton_backend_for(args):
    """The Triton backend where its variants run (a CUDA device, or the interpreter), with ``plan(x)`` for its launch
    sizes; None where they do not (asked not to, or triton missing: the reason printed)."""
    if args.no_triton or not (args.device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    try:
        from speculative_kernels.ops import triton_backend
    except ImportError as exc:
        print(f"skipping the Triton variants: {exc}")
        return None
    return triton_backend


def plan(triton_backend, x: torch.Tensor):
    """The Triton backend's launch plan for logits x [..., V]."""
    return triton_backend.make_plan(*x.shape, triton_backend.default_tuning(x.device))


def top_p_variants(args, top_p: float) -> dict:
    """name -> fn(logits [..., V], sampling) -> (source or cut value [...], cut index [...]), top-k with top-p."""
    k = args.top_k
    def rows(bound):  # the per-row path with every row's (k, top_p) as tensors, without and with a host bound
        def fn(x, s):
            lead = x.shape[:-1]
            top_k = torch.full(lead, k, device=x.device)
            top_p_rows = torch.full(lead, top_p, dtype=torch.float64, device=x.device)
            index = warping.row_thresholds(scaled(x, s.temperature), top_k, top_p_rows, top_k_bound=bound)[1]
            return index.expand(2, *lead)
        return fn

    fns = {"sort": lambda x, s: sorted_cut(scaled(x, s.temperature), k, top_p)[1].expand(2, *x.shape[:-1]),
           "topk-k": lambda x, s: torch.stack(_top_k_top_p_cut(x, s)),
           "rows-sort": rows(None), "rows-topk-bound": rows(2 * k)}
    triton_backend = triton_backend_for(args)
    if triton_backend is None:
        return fns

    def triton_sort(x, s):
        value, index = sorted_cut(triton_backend._scaled(x, s, plan(triton_backend, x)), k, top_p)
        return torch.stack([value.view(torch.int32), index])

    def triton_z_topk(x, s):
        value, index = warping.warp_thresholds(triton_backend._scaled(x, s, plan(triton_backend, x)), k, top_p)
        return torch.stack([value.view(torch.int32), index])

    def triton_topk(x, s):
        value, index = triton_backend._cuts(x, s, plan(triton_backend, x))
        return torch.stack([value.view(torch.int32), index])

    def triton_rows(copy_z: bool):  # per-row tensors with a host bound of 2k: z copied, or not (``_cuts``)
        def fn(x, s):
            from speculative_kernels.ops.sampling import RowSampling

            batch = x.shape[0]
            params = RowSampling(torch.full((batch,), s.temperature, device=x.device),
                                 torch.full((batch,), k, device=x.device),
                                 torch.full((batch,), top_p, dtype=torch.float64, device=x.device), True,
                                 top_k_bound=2 * k)
            rows_sampling = Sampling(rows=params)
            if copy_z:
                per_position = (lambda t: t.view(batch, 1).expand(x.shape[:-1]).reshape(-1))
                value, index = warping.row_thresholds(
                    triton_backend._scaled(x, rows_sampling, plan(triton_backend, x)), per_position(params.top_k),
                    per_position(params.top_p), 2 * k)
            else:
                value, index = triton_backend._cuts(x, rows_sampling, plan(triton_backend, x))
            return torch.stack([value.view(torch.int32), index])
        return fn

    fns["triton-sort"], fns["triton-z-topk-k"], fns["triton-topk-k"] = triton_sort, triton_z_topk, triton_topk
    fns["triton-rows-z-bound"], fns["triton-rows-bound"] = triton_rows(True), triton_rows(False)
    return fns


def check_same_top_p(fns: dict, target, draft, sampling) -> None:
    """Every top-p variant gives ``sort``'s cut: the same z at its source (as bits) and the same index."""
    for x in (target, draft):
        want = fns["sort"](x, sampling)
        want_z = source_z(x, want[1], sampling.temperature)
        for name, fn in fns.items():
            got = fn(x, sampling)
            triton = name.startswith("triton")
            got_z = got[0].reshape(want_z.shape) if triton else source_z(x, got[0], sampling.temperature)
            if not (torch.equal(got_z.reshape(-1), want_z.reshape(-1))
                    and torch.equal(got[1].reshape(-1), want[1].reshape(-1))):
                raise AssertionError(f"{name}: the cut differs from sort's on {tuple(x.shape)}")


def cut_variants(args, vocab: int) -> dict:
    """name -> fn(logits [..., V], sampling) -> source [...] (or a cut value [...] float32 for the Triton ones)."""
    k = args.top_k
    fns = {"element": lambda x, s: _element_cut(x, s)[0], "raw-topk": lambda x, s: _top_k_cut(x, k)[0]}
    select = cuda_select(args)
    if select is not None:
        fns["radix"] = lambda x, s: _top_k_cut(x, k, select)[0]
    for target in args.chunks:
        chunk = chunk_near(vocab, target, k)
        if chunk is not None and f"two-stage[{chunk}]" not in fns:
            fns[f"two-stage[{chunk}]"] = functools.partial(lambda x, s, c: two_stage_top_k_cut(x, k, c)[0], c=chunk)
    triton_backend = triton_backend_for(args)
    if triton_backend is None:
        return fns

    def triton_z_gather(x, s):
        source = warping.kth_largest_index(x, k).reshape(-1, 1)
        return triton_backend._scaled(x, s, plan(triton_backend, x)).gather(-1, source).reshape(x.shape[:-1])

    fns["triton-element"] = lambda x, s: warping.warp_thresholds(
        triton_backend._scaled(x, s, plan(triton_backend, x)), k, 1.0)[0]
    fns["triton-z-gather"] = triton_z_gather
    fns["triton-raw"] = lambda x, s: triton_backend._cuts(x, s, plan(triton_backend, x))[0]
    return fns


def check_same(fns: dict, target, draft, sampling) -> None:
    """Every variant's sources give element's z bit for bit (the Triton ones: their cut values, as bits)."""
    want = [source_z(x, _element_cut(x, sampling)[0], sampling.temperature) for x in (target, draft)]
    for name, fn in fns.items():
        for x, w in zip((target, draft), want):
            got = fn(x, sampling)
            got = got.view(torch.int32) if got.dtype == torch.float32 else source_z(x, got, sampling.temperature)
            if not torch.equal(got.reshape(-1), w.reshape(-1)):
                raise AssertionError(f"{name}: the cut's z differs from element's on {tuple(x.shape)}")


def make_inputs(batch, k, vocab, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    target = (torch.randn(batch, k + 1, vocab, generator=g, device=device) * 2).to(dtype)
    draft = (target[:, :k].float() + torch.randn(batch, k, vocab, generator=g, device=device)).to(dtype)
    return target, draft


def bench_config(args, batch, k, vocab, top_p) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    nbytes = batch * (2 * k + 1) * vocab * torch.finfo(dtype).bits // 8
    sets = max(2, min(args.max_sets, math.ceil(2 * L2_BYTES / nbytes))) if args.device == "cuda" else 1
    inputs = [make_inputs(batch, k, vocab, dtype, args.device, seed) for seed in range(sets)]
    sampling = Sampling(args.temperature, args.top_k, top_p)
    if top_p < 1.0:
        fns, base_name = top_p_variants(args, top_p), "sort"
        check_same_top_p(fns, *inputs[0], sampling)
    else:
        fns, base_name = cut_variants(args, vocab), "element"
        check_same(fns, *inputs[0], sampling)
    rows = []
    for name, fn in fns.items():
        calls = [functools.partial(lambda t, d, f: (f(t, sampling), f(d, sampling)), t, d, fn) for t, d in inputs]
        us = time_us(rotate(calls), args.device, cuda_graph=args.device == "cuda", rep_ms=args.rep_ms)
        rows.append(dict(variant=name, top_p=top_p, batch=batch, k=k, vocab=vocab, sets=sets, us=us,
                         gbps=nbytes / us / 1e3))
    base = next(r["us"] for r in rows if r["variant"] == base_name)
    for r in rows:
        r["speedup"] = base / r["us"]  # (against element with top-k alone, against sort with top-p)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--k", type=int, nargs="+", default=[4], help="draft tokens K (the target has K+1 rows)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.9],
                   help="1: top-k alone; below 1: top-k then top-p (Llama's generation_config: 0.9)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--chunks", type=int, nargs="*", default=[1024, 4096],
                   help="two-stage chunk sizes (the nearest divisor of V is used)")
    p.add_argument("--no-triton", action="store_true", help="leave out the Triton backend's cut")
    p.add_argument("--rep-ms", type=float, default=40, help="GPU: milliseconds of timed repeats per measurement")
    p.add_argument("--max-sets", type=int, default=16, help="cap on rotated input sets")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: B 1 3, K 2, V 1000, k 50")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.batch, args.k, args.vocab, args.chunks = "cpu", [1, 3], [2], [1000], [128, 500]
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    meta = environment(args.device)
    meta.update(dtype=args.dtype, top_k=args.top_k, temperature=args.temperature, cuda_graph=args.device == "cuda",
                cold_l2=args.device == "cuda")
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    columns = ["variant", "top_p", "batch", "k", "vocab", "sets", "us", "gbps", "speedup"]
    rows = []
    for top_p in args.top_p:
        for vocab in args.vocab:
            for k in args.k:
                for batch in args.batch:
                    new = bench_config(args, batch, k, vocab, top_p)
                    rows += new
                    print(markdown_table(new, columns).split("\n", 2)[-1], flush=True)
    print("\n" + markdown_table(rows, columns))
    stamp = meta["date"].replace(":", "").replace("-", "")
    written = save(rows, meta, args.out / f"cut-{args.device}{'-dry' if args.dry_run else ''}-{stamp}")
    print("wrote", ", ".join(str(p) for p in written))
    return rows


if __name__ == "__main__":
    main()
