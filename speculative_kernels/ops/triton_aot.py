"""Ahead-of-time compile of the Triton kernels exactly as the JIT builds them, for an NVIDIA target, with no GPU.

    python -m speculative_kernels.ops.triton_aot [--arch 90] [--resources] [--quick] [--vocab V --k K --batch B]
    python -m speculative_kernels.ops.triton_aot --batches 1 2 3 4 5 6 7 8   # compiled variants per kernel over B

The variants are not written out by hand. The backend's own launch code (``triton_backend.launch_verify`` /
``launch_sample``, ``compaction_triton``, ``lookup_triton``) runs on CPU tensors of a typical shape (bf16 logits,
V = 128256, K = 4, B = 1, an H100's 132 SMs; prompt lookup in a 4096-token buffer) with every kernel launch recorded
instead of executed (``recording``); each recorded launch is then bound by Triton's own JIT binder for the target
(``bind``), which gives the specialisation the JIT keys its cache on and compiles: ``tt.divisibility = 16`` on
16-byte aligned pointers and on integers divisible by 16, an integer equal to 1 as a constant, ``do_not_specialize``
arguments left generic, the launch's constexprs and ``num_warps``.
So ``--resources`` reports the registers of the kernels that run, and ``--batches`` counts how many variants a range
of batch sizes compiles (one per kernel and mode is the goal: a new batch size must not cost a compilation).

Checked with Triton 3.6 (the GPU image's; CI compiles ``--quick`` with it) and 3.9: every mode at several
(B, V, K), V = 1 and 2 and V not a multiple of 4 included, in bf16, fp16 and fp32 (2026-11-27). Must run without
TRITON_INTERPRET (the kernels must be real JIT functions).
"""

import argparse
import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

from . import compaction_triton, lookup_triton, triton_backend, triton_select
from .randomness import Randomness
from .sampling import RowSampling, Sampling

# An H100's SM count, so the recorded plans (chunks per row, grid) are the ones that GPU launches.
H100 = triton_backend.Tuning(num_sms=132)


@dataclasses.dataclass
class Launch:
    """One recorded ``wrap_triton(kernel)[grid](*args, **kwargs)``."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


class _Recorder:
    """Stands in for ``torch.library.wrap_triton``: ``recorder(kernel)[grid](...)`` appends a ``Launch``."""

    def __init__(self):
        self.launches: list[Launch] = []

    def __call__(self, kernel):
        recorder = self

        class _Grid:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.launches.append(Launch(kernel, grid, args, kwargs))

        return _Grid()


@contextlib.contextmanager
def recording():
    """Record the Triton backends' launches instead of running them, with CPU tensors taking the GPU's decisions
    (libdevice math, the GPU's compaction and lookup tiles). Yields the list the launches are appended to."""
    recorder = _Recorder()
    cuda = torch.device("cuda")
    saved = (triton_backend.wrap_triton, compaction_triton.wrap_triton, lookup_triton.wrap_triton,
             triton_select.wrap_triton, triton_backend.precise_math, compaction_triton.slot_tile,
             lookup_triton.window_tile)
    saved_direct = (triton_backend.kernel_itself, compaction_triton.kernel_itself, lookup_triton.kernel_itself)
    precise, slot_tile = triton_backend.precise_math, compaction_triton.slot_tile
    window_tile = lookup_triton.window_tile
    triton_backend.wrap_triton = compaction_triton.wrap_triton = lookup_triton.wrap_triton = recorder
    triton_select.wrap_triton = recorder
    # the plain eager path's launches (eager.py: the ops' bodies called directly, with the kernels themselves)
    triton_backend.kernel_itself = compaction_triton.kernel_itself = lookup_triton.kernel_itself = recorder
    triton_backend.precise_math = lambda device: precise(cuda)
    compaction_triton.slot_tile = lambda device: slot_tile(cuda)
    lookup_triton.window_tile = lambda device: window_tile(cuda)
    try:
        yield recorder.launches
    finally:
        (triton_backend.wrap_triton, compaction_triton.wrap_triton, lookup_triton.wrap_triton,
         triton_select.wrap_triton, triton_backend.precise_math, compaction_triton.slot_tile,
         lookup_triton.window_tile) = saved
        triton_backend.kernel_itself, compaction_triton.kernel_itself, lookup_triton.kernel_itself = saved_direct


@dataclasses.dataclass
class Bound:
    """A launch as the JIT sees it: its cache key and what it compiles (signature, constexprs, attrs, options)."""

    name: str
    key: str
    source: ASTSource
    options: dict


def bind(launch: Launch, target: GPUTarget) -> Bound:
    """Triton's JIT binding of a recorded launch for ``target`` (``JITFunction.run`` up to the compile call)."""
    fn = launch.kernel
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for option in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # what run() adds (3.9 has both, 3.6 one)
        if hasattr(knobs.compilation, option):
            kwargs[option] = getattr(knobs.compilation, option)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    key = compute_cache_key({}, specialization, options)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return Bound(launch.name, key, ASTSource(fn, signature, constexprs, attrs), options.__dict__)


def _rows(value: int, batch: int) -> torch.Tensor:
    return torch.full((batch,), value, dtype=torch.int64)


def record_verify_modes(batch: int, k: int, vocab: int, dtype=torch.bfloat16, quick: bool = False,
                        tuning=H100) -> list[tuple[str, Launch]]:
    """(mode, launch) for every kernel launch of the verify/sample modes at one size (``quick``: the most general
    sampling mode and greedy with draft logits only). The logits are zeros: nothing is computed."""
    target = torch.zeros(batch, k + 1, vocab, dtype=dtype)
    draft = torch.zeros(batch, k, vocab, dtype=dtype)
    tokens = torch.zeros(batch, k, dtype=torch.int64)
    seed, offset = _rows(1, batch), _rows(0, batch)
    limit = torch.full((batch,), k, dtype=torch.int64)
    rows = RowSampling(torch.full((batch,), 0.8, dtype=torch.float32), torch.full((batch,), 50, dtype=torch.int64),
                       torch.full((batch,), 0.9, dtype=torch.float64), True)  # (never torch's default dtype)
    per_row = Sampling(rows=rows)
    # mode -> (draft logits, "sample" or None, Sampling, num_draft_tokens); the sampler is K = 0 verification
    modes = {
        "greedy": (draft, Sampling(0.0, 0, 1.0), None),
        "greedy one-hot": (None, Sampling(0.0, 0, 1.0), None),
        "greedy limit": (None, Sampling(0.0, 0, 1.0), limit),
        "sampling": (draft, Sampling(0.8, 0, 1.0), None),
        "sampling one-hot": (None, Sampling(0.8, 0, 1.0), None),
        "sampling top-k": (draft, Sampling(0.8, 50, 1.0), None),
        "sampling top-k/top-p": (draft, Sampling(0.8, 50, 0.9), None),
        "sampling top-k/top-p one-hot": (None, Sampling(0.8, 50, 0.9), None),
        "per-row limit": (draft, per_row, limit),
        "per-row top_k_bound": (draft, Sampling(rows=dataclasses.replace(rows, top_k_bound=64)), None),
        "per-row one-hot limit": (None, Sampling(rows=dataclasses.replace(rows, cut=False)), limit),
        "sample": ("sample", Sampling(0.8, 0, 1.0), None),
        "sample top-p": ("sample", Sampling(0.8, 0, 0.9), None),
        "sample per-row": ("sample", per_row, None),
    }
    if quick:
        modes = {m: modes[m] for m in ("greedy", "sampling top-k", "sampling top-k/top-p", "per-row limit")}
    out = []
    randomness = Randomness(seed, offset)
    for mode, (d, sampling, num_draft_tokens) in modes.items():
        with recording() as launches:
            if isinstance(d, str):
                triton_backend.launch_sample(target[:, 0], sampling, randomness, tuning)
            else:
                triton_backend.launch_verify(target, d, tokens, sampling, randomness, tuning,
                                             num_draft_tokens=num_draft_tokens)
        out += [(mode, launch) for launch in launches]
    return out


def record_compaction(batch: int = 1, heads: int = 8, slots: int = 4096, head_dim: int = 128,
                      dtype=torch.bfloat16) -> list[tuple[str, Launch]]:
    """The KV-cache compaction launch for one layer tensor [B, H, S, D] (a static cache's used prefix)."""
    cache = torch.empty(batch, heads, slots + 64, head_dim, dtype=dtype)  # (never read: only launched)
    mask = torch.ones(batch, slots, dtype=torch.int64)
    with recording() as launches:
        compaction_triton.compact_kv([cache[:, :, :slots]], mask)
    return [("compact_kv", launch) for launch in launches]


def record_lookup(batch: int = 1, width: int = 4096, num_tokens: int = 10, max_ngram: int = 2,
                  quick: bool = False) -> list[tuple[str, Launch]]:
    """The prompt-lookup launches for a context buffer [B, W] (HF's defaults: 10 tokens, 2-grams), each of the
    match rules (first or latest match, periodic or not; ``quick``: the drafter's, latest and periodic)."""
    tokens = torch.zeros(batch, width, dtype=torch.int64)
    start, end = torch.zeros(batch, dtype=torch.int64), torch.full((batch,), width, dtype=torch.int64)
    out = []
    for prefer_latest in (True,) if quick else (False, True):
        for periodic in (True,) if quick else (False, True):
            with recording() as launches:
                lookup_triton.prompt_lookup(tokens, start, end, num_tokens, max_ngram, prefer_latest, periodic)
            out += [(f"lookup latest={prefer_latest} periodic={periodic}", launch) for launch in launches]
    return out


def variants(arch: int = 90, batch: int = 1, k: int = 4, vocab: int = 128256, quick: bool = False) -> list:
    """(label, Bound) per distinct compilation of the typical launches, in launch order."""
    target = GPUTarget("cuda", arch, 32)
    seen, out = set(), []
    for mode, launch in record_verify_modes(batch, k, vocab, quick=quick) + record_compaction(batch) + \
            record_lookup(batch, quick=quick):
        bound = bind(launch, target)
        if (bound.name, bound.key) not in seen:
            seen.add((bound.name, bound.key))
            out.append((f"{bound.name} [{mode}]", bound))
    return out


def variants_over_batches(batches, arch: int = 90, k: int = 4, vocab: int = 128256) -> dict[str, int]:
    """Distinct JIT compilations per (kernel, mode) over the batch sizes ``batches`` (ideally 1 each), the prompt-lookup
    buffer 4000 + B tokens wide."""
    target = GPUTarget("cuda", arch, 32)
    keys: dict[str, set] = {}
    for batch in batches:
        # (the prompt-lookup buffer's width changes too: a request's prompt length sets it, and the row stride with it)
        lookups = record_lookup(batch, width=4000 + batch)
        for mode, launch in record_verify_modes(batch, k, vocab) + record_compaction(batch) + lookups:
            keys.setdefault(f"{launch.name} [{mode}]", set()).add(bind(launch, target).key)
    return {label: len(found) for label, found in keys.items()}


def _resources(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(line.strip() for line in out.splitlines() if "REG" in line)


def global_loads(ptx: str) -> str:
    """The kinds of global loads in a kernel's PTX, e.g. "b32,v4.b32" (v4: 128-bit vector loads)."""
    return ",".join(sorted(set(re.findall(r"ld\.global\.(?:nc\.)?([\w.]+)", ptx))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per verification")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--resources", action="store_true")
    parser.add_argument("--quick", action="store_true", help="greedy and the most general sampling mode only")
    parser.add_argument("--batches", type=int, nargs="+",
                        help="instead of compiling: count the distinct JIT variants per kernel over these batch sizes")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    if args.batches:
        counts = variants_over_batches(args.batches, args.arch, args.k, args.vocab)
        for label, count in counts.items():
            print(f"variants {count} {label}")
        raise SystemExit(0 if all(c == 1 for c in counts.values()) else 1)
    target = GPUTarget("cuda", args.arch, 32)
    for label, bound in variants(args.arch, args.batch, args.k, args.vocab, args.quick):
        compiled = triton.compile(bound.source, target=target, options=bound.options)
        extra = _resources(compiled.asm["cubin"]) if args.resources else ""
        loads = global_loads(compiled.asm["ptx"])
        print(f"ok sm_{args.arch} {label} num_warps={bound.options['num_warps']} loads={loads} {extra}", flush=True)


if __name__ == "__main__":
    main()
