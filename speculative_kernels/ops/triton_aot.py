"""Ahead-of-time compile of every Triton kernel variant for an NVIDIA target, with no GPU needed.

    python -m speculative_kernels.ops.triton_aot [--arch 90] [--resources]

Triton's NVIDIA backend (with its bundled ptxas) compiles to cubin without a device, so a CPU-only CI can still
catch kernels that only the interpreter accepts. ``--resources`` prints registers / spills per variant
(via the bundled cuobjdump). Must run without TRITON_INTERPRET (the kernels must be real JIT functions).
"""

import argparse
import itertools
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .compaction_triton import compact_kv_kernel
from .triton_kernels import finish_greedy_kernel, scale_kernel, stats_kernel
from .triton_race import finish_sample_kernel, race_kernel


def _sig(fn, types: dict, constexprs: dict) -> ASTSource:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = types.get(name, "*fp32")
        else:
            signature[name] = types.get(name, "i32")
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def variants(logit_type: str = "*bf16", block_v: int = 2048, quick: bool = False):
    """(name, ASTSource, num_warps) for the variants the backend launches; ``quick``: the most general of each."""
    unit = {"stride_tv": 1, "stride_dv": 1}
    ints = {"WSI_ptr": "*i32", "RI_ptr": "*i32", "CUT_TI_ptr": "*i32", "CUT_DI_ptr": "*i32", "X_ptr": "*i64",
            "SEED_ptr": "*i64", "OFFSET_ptr": "*i64", "OUT_ptr": "*i64", "NUM_ptr": "*i64",
            "T_ptr": logit_type, "D_ptr": logit_type, "temperature": "fp32"}
    warps = max(1, min(8, block_v // 256))
    race_block = max(16, block_v // 2)  # the backend's default race tile is half the pass-1 tile
    race_warps = max(1, min(4, race_block // 256))
    combos = [(True, True, False)] if quick else list(itertools.product([True, False], repeat=3))
    for draft, cut, greedy in combos:
        flags = dict(HAS_DRAFT=draft, HAS_CUT=cut and not greedy, GREEDY=greedy, SCALE=True, PRECISE=True,
                     BLOCK_V=block_v)
        yield f"stats draft={draft} cut={cut} greedy={greedy}", _sig(stats_kernel, ints, {**unit, **flags}), warps
    for draft, cut, residual in [(True, True, True)] if quick else itertools.product([True, False], repeat=3):
        flags = dict(HAS_DRAFT=draft, HAS_CUT=cut, SCALE=True, RESIDUAL=residual, PRECISE=True, BLOCK_K=8,
                     BLOCK_C=64, BLOCK_V=race_block)
        yield (f"race draft={draft} cut={cut} residual={residual}", _sig(race_kernel, ints, {**unit, **flags}),
               race_warps)
    yield "finish_greedy", _sig(finish_greedy_kernel, ints, dict(HAS_DRAFT=True, BLOCK_K=8, BLOCK_C=64)), 1
    yield "finish_sample", _sig(finish_sample_kernel, ints, dict(RESIDUAL=True, BLOCK_K=8, BLOCK_C=64)), 1
    yield "scale", _sig(scale_kernel, {"X_ptr": logit_type, "temperature": "fp32"},
                        dict(SCALE=True, BLOCK_V=block_v)), warps
    # KV-cache hole compaction (the rollback kernel): the cache viewed as 16-bit integers (bf16/fp16), head_dim 128.
    yield "compact_kv", _sig(compact_kv_kernel, {"KV_ptr": "*i16", "M_ptr": "*i8"},
                             dict(BLOCK_S=64, BLOCK_D=128)), 4


def _resources(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(line.strip() for line in out.splitlines() if "REG" in line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--block-v", type=int, default=2048)
    parser.add_argument("--resources", action="store_true")
    parser.add_argument("--quick", action="store_true", help="only the most general variant of each kernel")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    target = GPUTarget("cuda", args.arch, 32)
    for name, src, num_warps in variants(block_v=args.block_v, quick=args.quick):
        compiled = triton.compile(src, target=target, options={"num_warps": num_warps})
        extra = _resources(compiled.asm["cubin"]) if args.resources else ""
        print(f"ok sm_{args.arch} {name} {extra}", flush=True)


if __name__ == "__main__":
    main()
