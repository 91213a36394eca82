"""Host time of Triton's JIT launcher before the launch, per kernel of the verification op, without a GPU.

``JITFunction.run`` binds each launch's arguments and computes its specialization (per argument: type, 16-byte
alignment of pointers, integers equal to 1 or divisible by 16) and the cache key, at every launch, before it looks
the compiled kernel up and calls the launcher. That part is pure Python and C++ on the host, so it can be timed on a
CPU: the backend's launches are recorded at a GPU's sizes (``triton_aot.record_verify_modes``: bf16, K = 4,
V = 128256, B = 1, an H100's plan) and each is bound with Triton's own binder for sm_90, as the JIT does. (Not timed:
``launch_metadata`` and the C launcher, which need a device.)

    env -u TRITON_INTERPRET python benchmarks/triton_launch_binding.py [--out FILE]   # a Triton with a CUDA backend
"""

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE.parent))  # the package, when it is not installed

from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import compute_cache_key, create_function_from_signature  # noqa: E402

from speculative_kernels.ops import triton_aot  # noqa: E402


def binding_us(launch, backend, calls: int) -> float:
    """Best mean over 7 rounds of ``calls`` of the binder and the cache key (thread CPU time, µs)."""
    fn = launch.kernel
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for option in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # what run() adds (as triton_aot.bind)
        if hasattr(knobs.compilation, option):
            kwargs[option] = getattr(knobs.compilation, option)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    key_cache = {}

    def once():
        _, specialization, options = binder(*launch.args, **kwargs)
        return compute_cache_key(key_cache, specialization, options)

    for _ in range(100):
        once()
    best = float("inf")
    for _ in range(7):
        start = time.thread_time()
        for _ in range(calls):
            once()
        best = min(best, (time.thread_time() - start) / calls)
    return best * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    rows, per_mode = [], {}
    for mode, launch in triton_aot.record_verify_modes(1, 4, 128256):
        us = binding_us(launch, backend, args.calls)
        rows.append({"mode": mode, "kernel": launch.name, "args": len(launch.args), "kwargs": len(launch.kwargs),
                     "us": us})
        per_mode[mode] = per_mode.get(mode, 0.0) + us
        print(f"{mode:26} {launch.name:22} {len(launch.args):3d} args {len(launch.kwargs):3d} kwargs {us:7.1f} µs")
    print()
    for mode, us in per_mode.items():
        count = sum(r["mode"] == mode for r in rows)
        print(f"{mode:26} {count:3d} launches {us:7.1f} µs of binding per call")
    if args.out:
        import triton
        import torch

        args.out.write_text(json.dumps({"triton": triton.__version__, "torch": torch.__version__, "rows": rows,
                                        "per_mode_us": per_mode}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
