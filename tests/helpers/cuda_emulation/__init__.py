"""The CUDA kernels of ``csrc/`` run on the CPU: a host build of the unmodified ``verify_kernels.cu``,
``rollback_kernels.cu`` and ``topk_kernels.cu`` in which every CUDA thread is a fiber, so the GPU tests' own checks
can run where no GPU is (this project's usual machine).

``build(out_dir)`` compiles it (g++ and the CUDA toolkit's headers; ~40 s): ``transform`` rewrites only the kernel
launches (``kernel<<<grid, block, shared, stream>>>(args)`` -> ``emu::launch``, counted per file in ``LAUNCHES``),
``extern __shared__`` arrays (-> the launch's dynamic shared memory) and ``cudaGetLastError()``; ``shim.h`` (included
before every source) maps the CUDA keywords and intrinsics onto the host: ``__shared__`` is ``static`` (one block runs
at a time), the ``_rn`` intrinsics are IEEE float operations, ``max.NaN.f32`` takes the sources' portable branch;
``runtime.cpp`` runs each block's threads as fibers: ``__syncthreads``, full-mask warp shuffles and ballots are real
rendezvous points, and a barrier reached at different lines or after some threads exited, a shuffle with an exited
lane, a partial mask, a deadlock, a spin-wait that backs off (``__nanosleep``: it waits for a block that has not run,
which one block at a time never releases) or a launch configuration the device refuses (block > 1024 threads,
grid.y > 65535, dynamic shared memory > 48 KiB) is an error (``EmulatedOps.check``). ``cudaMemsetAsync`` is a
``memset``; launches and memsets are counted (``EmulatedOps.stream_ops``). Dynamic shared memory ends at an inaccessible page
and is refilled with garbage before each block. ``capi.cpp`` is the C entry point the ops below call through ctypes.

``EmulatedOps`` mirrors ``bindings.cpp`` (unit stride over V, mixed dtypes promoted to float32, contiguous cut and
per-row tensors, the workspace) and ``rollback_bindings.cpp`` (its checks, [B, H, S, D] strides as they are) and copies
every tensor it passes into memory whose end touches an inaccessible page, keeping its strides and its 16-byte
alignment, so a read past a buffer faults (the in-place KV cache is copied back over its whole span, gaps between
its rows included, so a stray store there shows). ``op_kth_largest_index`` mirrors ``topk_bindings.cpp``.
``verify`` / ``sample`` are ``cuda_backend``'s (their top-k cut from the emulated select) and ``compact_kv``
is ``compaction_cuda``'s, through ``ops.cuda_host`` with these ops in place of ``torch.ops.speculative_kernels_cuda``.

What it cannot show: the real NaN-propagating max instructions (their documented semantics are emulated), CUDA's
``expf`` (glibc's is used: the softmax sum may differ by an ulp), anything about timing, occupancy or memory ordering
across blocks (blocks run one after another: in order, or last-first with ``set_reverse_blocks``). A GPU run still validates the kernels; this catches index,
tie-break, barrier and shuffle errors first.
"""

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from speculative_kernels.ops.cuda_host import compact_kv_with, sample_with, verify_with

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[2] / "csrc"
# torch's extension builder's nvcc flags that change what the sources mean (no implicit half/bf16 conversions)
TORCH_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
               "-D__CUDA_NO_HALF2_OPERATORS__")
# IEEE arithmetic as the kernels' (no fused multiply-adds the source does not write, no fast math)
CXX_FLAGS = ("-std=c++20", "-O2", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-U_FORTIFY_SOURCE",
             "-Wno-comment", "-Wno-unknown-pragmas", "-Wno-class-memaccess")
_LAUNCH = re.compile(r"(\w+(?:<[^;<>]*>)?)<<<([^,]+),\s*([^,]+),\s*([^,]+),\s*stream>>>\(([^;]*)\);")
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w:]*(?:\s+[A-Za-z_]\w*)*)\s+"
                            r"(\w+)\[\];")
# kernel launches per source (count a new one here)
LAUNCHES = {"verify_kernels.cu": 6, "rollback_kernels.cu": 1, "topk_kernels.cu": 1}
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # csrc's LogitDtype


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include directory (cuda_bf16.h): CUDA_HOME's, nvcc's, or /usr/local/cuda's; None if none."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    candidates.append("/usr/local/cuda")
    for root in candidates:
        if root and (Path(root) / "include" / "cuda_bf16.h").is_file():
            return Path(root) / "include"
    return None


def unavailable_reason() -> str | None:
    """Why the emulation cannot be built here (no C++ compiler, no CUDA headers), or None."""
    if shutil.which("g++") is None:
        return "no g++ on PATH"
    try:
        major = int(subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True, timeout=60).stdout
                    .split(".")[0])
    except (OSError, subprocess.SubprocessError, ValueError):
        return "could not read g++'s version"
    if major < 11:
        return f"g++ {major} lacks C++20's <source_location> (g++ 11 or newer builds the emulation)"
    if cuda_include_dir() is None:
        return "no CUDA toolkit headers (cuda_bf16.h under CUDA_HOME, nvcc's toolkit or /usr/local/cuda)"
    return None


def transform(source: str, name: str = "verify_kernels.cu") -> str:
    """A kernel source of csrc/ (``name``, a key of ``LAUNCHES``) -> host C++: each launch becomes ``::emu::launch``
    (with its dynamic shared bytes), each ``extern __shared__ T name[];`` a pointer to the launch's dynamic shared
    memory, ``cudaGetLastError()`` -> cudaSuccess."""
    host, n = _LAUNCH.subn(lambda m: f"::emu::launch([&] {{ {m.group(1)}({m.group(5)}); }}, dim3({m.group(2)}), "
                                     f"dim3({m.group(3)}), {m.group(4)});", source)
    if n != LAUNCHES[name]:
        raise RuntimeError(f"expected {LAUNCHES[name]} kernel launches of the form kernel<<<grid, block, shared, "
                           f"stream>>>(args) in {name}, found {n}: update tests/helpers/cuda_emulation")
    host = _EXTERN_SHARED.sub(
        lambda m: f"{m.group(1)}* {m.group(2)} = static_cast<{m.group(1)}*>(::emu::dynamic_shared());", host)
    if "extern __shared__" in host:
        raise RuntimeError(f"an extern __shared__ declaration of {name} is not of the form "
                           "extern __shared__ [__align__(n)] T name[];: update tests/helpers/cuda_emulation")
    return host.replace("cudaGetLastError()", "cudaSuccess")


def build(out_dir: Path, csrc: Path = CSRC) -> Path:
    """Compile the emulation of ``csrc`` into ``out_dir``; returns the shared library's path. RuntimeError with the
    compiler's output if a unit does not compile."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hosts = []
    for name in LAUNCHES:
        hosts.append(out_dir / f"{Path(name).stem}_host.cpp")
        hosts[-1].write_text(transform((csrc / name).read_text(), name))
    flags = [*CXX_FLAGS, f"-I{cuda_include_dir()}", f"-I{csrc}", "-include", str(HERE / "shim.h"), *TORCH_FLAGS]
    units = [*hosts, HERE / "runtime.cpp", HERE / "capi.cpp"]
    jobs = [(subprocess.Popen(["g++", *flags, "-c", str(u), "-o", str(out_dir / f"{u.stem}.o")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), u) for u in units]
    for job, unit in jobs:
        output, _ = job.communicate()
        if job.returncode != 0:
            raise RuntimeError(f"g++ failed on {unit.name}:\n{output}")
    library = out_dir / "libcuda_emulation.so"
    subprocess.run(["g++", "-shared", *(str(out_dir / f"{u.stem}.o") for u in units), "-o", str(library)],
                   check=True, capture_output=True)
    return library


def _garbage_workspace(num_bytes: int) -> torch.Tensor:
    """A workspace of ``num_bytes`` filled with a pattern, not zeros: its contents are irrelevant by contract
    (verify_kernels.cuh), and a pass that counted on zeroed memory (the fused pass's tickets) shows here."""
    return torch.full((max(num_bytes, 1),), 0xA5, dtype=torch.uint8)


class EmulatedOps:
    """``torch.ops.speculative_kernels_cuda.verify`` / ``.sample`` with the arguments ``bindings.cpp`` takes, run by
    the emulation library at ``library``; ``verify`` / ``sample`` are the backend's (``ops.cuda_host``)."""

    def __init__(self, library: Path):
        self.lib = lib = ctypes.CDLL(str(library))
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.emu_alloc.restype, lib.emu_alloc.argtypes = p, [ctypes.c_size_t]
        lib.emu_workspace_bytes.restype, lib.emu_workspace_bytes.argtypes = ctypes.c_size_t, [i32] * 4
        lib.emu_verify.restype = i32
        lib.emu_verify.argtypes = [i32, i32, i32, i32, p, i64, i64, p, i64, i64, p, f32, p, p, p, p, p, p, p, i64, p,
                                   i64, i32, p, p, p, ctypes.c_size_t]
        lib.emu_sample.restype = i32
        lib.emu_sample.argtypes = [i32, p, i32, i32, i64, f32, p, p, p, p, i64, p, i64, i32, p, p, ctypes.c_size_t]
        lib.emu_compact_kv.restype = i32
        lib.emu_compact_kv.argtypes = [p, i32, i32, i32, i32, i32, i64, i64, i64, p, i64]
        lib.emu_kth_workspace_bytes.restype, lib.emu_kth_workspace_bytes.argtypes = ctypes.c_size_t, [i32, i32]
        lib.emu_kth_blocks_per_row.restype, lib.emu_kth_blocks_per_row.argtypes = i32, [i32, i32, i32]
        lib.emu_kth_largest.restype = i32
        lib.emu_kth_largest.argtypes = [i32, p, i32, i32, i32, i64, i64, i32, p, i32, p, ctypes.c_size_t]
        lib.emu_errors.restype = i32
        lib.emu_launches.restype, lib.emu_launches.argtypes = ctypes.c_longlong, []
        lib.emu_memsets.restype, lib.emu_memsets.argtypes = ctypes.c_longlong, []
        lib.emu_set_reverse_order.restype, lib.emu_set_reverse_order.argtypes = None, [i32]
        lib.emu_set_reverse_blocks.restype, lib.emu_set_reverse_blocks.argtypes = None, [i32]
        self._buffers = []  # guarded copies stay mapped while the ops' results may still view them (small tests)
        # The k-th largest select's blocks per row: None = topk_bindings.cpp's choice for an H200 (132 SMs), which
        # at the CPU's small vocabularies is one block; a test sets more to spread a row over several blocks.
        self.select_blocks_per_row: int | None = None

    def set_reverse_order(self, reverse: bool) -> None:
        """Run each block's ready threads last-first (True) or first-first (the default) between rendezvous points: a
        race that one order hides (a load after another thread's store with no barrier between) the other shows."""
        self.lib.emu_set_reverse_order(int(bool(reverse)))

    def set_reverse_blocks(self, reverse: bool) -> None:
        """Run each grid's blocks last-first (True) or from block (0, 0) (the default). A GPU runs them in any order
        and any of them may finish last: a kernel that counted on the order (the fused pass's combine taking the
        highest chunk for the row's last block) shows in one of the two."""
        self.lib.emu_set_reverse_blocks(int(bool(reverse)))

    def stream_ops(self) -> tuple[int, int]:
        """(kernel launches, cudaMemsetAsync calls) made so far: a call's counts are the differences around it."""
        return self.lib.emu_launches(), self.lib.emu_memsets()

    def check(self) -> None:
        """RuntimeError if the emulation reported an error (a divergent barrier, a shuffle with an exited lane, ...;
        the details are on stderr)."""
        if self.lib.emu_errors():
            raise RuntimeError("the CUDA emulation reported an error (see stderr)")

    def _guarded(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A copy of t (its sizes, strides and the 16-byte alignment of its data pointer, as a CUDA allocation gives)
        in memory whose end, rounded up to 16 bytes, touches an inaccessible page."""
        if t is None:
            return None
        t = t.detach().cpu()
        size = t.element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 1
        lead = (t.storage_offset() * size) % 16
        nbytes = lead + span * size
        address = self.lib.emu_alloc(nbytes)
        if not address:
            raise MemoryError("emu_alloc failed")
        raw = (ctypes.c_char * nbytes).from_address(address)
        self._buffers.append(raw)
        body = torch.frombuffer(raw, dtype=torch.uint8)[lead : lead + span * size].view(t.dtype)
        if t.numel():
            body.copy_(t.as_strided((span,), (1,), t.storage_offset()))
        return body.as_strided(t.shape, t.stride())

    @staticmethod
    def _ptr(t):
        return None if t is None else t.data_ptr()

    @staticmethod
    def _unit(t):
        return t if t.stride(-1) == 1 else t.contiguous()

    def op_verify(self, target, draft, draft_tokens, temperature, temperature_rows, target_cut_source,
                  target_cut_index, draft_cut_source, draft_cut_index, seed, offset, seed_per_row, num_draft_tokens):
        """bindings.cpp's verify_cuda."""
        batch, positions, vocab = target.shape
        k = positions - 1
        sampling = temperature > 0 or temperature_rows is not None
        target = self._unit(target)
        if draft is not None:
            draft = self._unit(draft)
            if draft.dtype != target.dtype:  # mixed dtypes: both to float32 (exact for fp16/bf16)
                target, draft = target.float(), draft.float()
        rows = None if temperature_rows is None else temperature_rows.float().contiguous()
        limits = None if num_draft_tokens is None else num_draft_tokens.to(torch.int64).contiguous()
        cuts = [None] * 4
        if sampling and target_cut_source is not None:
            cuts[:2] = target_cut_source.contiguous(), target_cut_index.contiguous()
            if draft is not None:
                cuts[2:] = draft_cut_source.contiguous(), draft_cut_index.contiguous()
        g = self._guarded
        t, d, tokens, r, n = (g(x) for x in (target, draft, draft_tokens.to(torch.int64).contiguous(), rows, limits))
        c0, c1, c2, c3 = (g(x) for x in cuts)
        s, o = g(seed), g(offset)
        out_tokens, out_n = g(torch.empty(batch, k + 1, dtype=torch.int64)), g(torch.empty(batch, dtype=torch.int64))
        ws_bytes = self.lib.emu_workspace_bytes(batch, k, vocab, int(draft is not None))
        ws = g(_garbage_workspace(ws_bytes))
        p = self._ptr
        error = self.lib.emu_verify(
            DTYPES[t.dtype], batch, k, vocab, p(t), t.stride(0), t.stride(1), p(d), d.stride(0) if d is not None else 0,
            d.stride(1) if d is not None else 0, p(tokens), float(temperature), p(r), p(n), p(c0), p(c1), p(c2), p(c3),
            p(s), s.stride(0), p(o), o.stride(0), int(bool(seed_per_row)), p(out_tokens), p(out_n), p(ws), ws_bytes)
        self.check()
        if error:
            raise RuntimeError(f"verify_launch returned CUDA error {error}")
        return out_tokens.clone(), out_n.clone()

    def op_sample(self, logits, temperature, temperature_rows, cut_source, cut_index, seed, offset, seed_per_row):
        """bindings.cpp's sample_cuda."""
        logits = self._unit(logits)
        batch, vocab = logits.shape
        rows = None if temperature_rows is None else temperature_rows.float().contiguous()
        if not ((temperature > 0 or rows is not None) and cut_source is not None):
            cut_source = cut_index = None
        g = self._guarded
        x, r, cs, ci, s, o = (g(t) for t in (logits, rows, cut_source, cut_index, seed, offset))
        out = g(torch.empty(batch, dtype=torch.int64))
        ws_bytes = self.lib.emu_workspace_bytes(batch, 0, vocab, 0)
        ws = g(_garbage_workspace(ws_bytes))
        p = self._ptr
        error = self.lib.emu_sample(DTYPES[x.dtype], p(x), batch, vocab, x.stride(0), float(temperature), p(r), p(cs),
                                    p(ci), p(s), s.stride(0), p(o), o.stride(0), int(bool(seed_per_row)), p(out),
                                    p(ws), ws_bytes)
        self.check()
        if error:
            raise RuntimeError(f"sample_launch returned CUDA error {error}")
        return out.clone()

    def op_kth_largest_index(self, logits, k):
        """topk_bindings.cpp's kth_largest_index_cuda: logits [B, V] or [B, J, V] -> [B] / [B, J] int32, the smallest
        id of each row holding its k-th largest value; the workspace zeroed (as the binding's at::zeros)."""
        if logits.dim() not in (2, 3):
            raise RuntimeError(f"logits must be [B, V] or [B, J, V], got shape {list(logits.shape)}")
        if logits.dtype not in DTYPES:
            raise RuntimeError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
        vocab = logits.shape[-1]
        if not 1 <= k <= vocab:
            raise RuntimeError(f"k must be in [1, V] = [1, {vocab}], got {k}")
        logits = self._unit(logits)
        flat = logits.dim() == 2
        batch, positions = logits.shape[0], 1 if flat else logits.shape[1]
        rows = batch * positions
        out = torch.empty(logits.shape[:-1], dtype=torch.int32)
        if rows == 0:
            return out
        bits = 32 if logits.dtype == torch.float32 else 16
        x = self._guarded(logits)
        out = self._guarded(out)
        blocks = self.select_blocks_per_row or self.lib.emu_kth_blocks_per_row(rows, vocab, 132)
        ws_bytes = self.lib.emu_kth_workspace_bytes(bits, rows)
        ws = self._guarded(torch.zeros(ws_bytes, dtype=torch.uint8))
        error = self.lib.emu_kth_largest(bits, x.data_ptr(), batch, positions, vocab, x.stride(0),
                                         0 if flat else x.stride(1), k, out.data_ptr(), blocks, ws.data_ptr(), ws_bytes)
        self.check()
        if error:
            raise RuntimeError(f"kth_largest_launch returned CUDA error {error}")
        return out.clone()

    def op_compact_kv(self, kv, slot_mask):
        """rollback_bindings.cpp's compact_kv_cuda (its checks, as RuntimeError): in place on kv [B, H, S, D], run on
        a guarded copy of kv's whole span (the elements between its rows too) that is then copied back over it."""
        if kv.dim() != 4:
            raise RuntimeError(f"kv must be [B, H, S, D], got shape {list(kv.shape)}")
        if slot_mask.dim() != 2:
            raise RuntimeError(f"slot_mask must be [B, S], got shape {list(slot_mask.shape)}")
        if slot_mask.dtype != torch.int8:
            raise RuntimeError(f"slot_mask must be int8, got {slot_mask.dtype}")
        if slot_mask.shape[0] != kv.shape[0] or slot_mask.shape[1] != kv.shape[2]:
            raise RuntimeError(f"slot_mask has shape {list(slot_mask.shape)} but kv has {list(kv.shape)} ([B, S] must "
                               "match)")
        if not (slot_mask.stride(1) == 1 or slot_mask.shape[1] <= 1):
            raise RuntimeError("slot_mask must have unit stride over slots")
        if not (kv.stride(3) == 1 or kv.shape[3] <= 1):
            raise RuntimeError(f"kv must have unit stride over the head dimension, got strides {kv.stride()}")
        if any(not 0 <= n <= 2**31 - 1 for n in kv.shape):
            raise RuntimeError(f"a size of kv {list(kv.shape)} is out of the supported range [0, 2^31)")
        if kv.element_size() not in (1, 2, 4, 8):
            raise RuntimeError(f"kv must have 1-, 2-, 4- or 8-byte elements, got {kv.dtype}")
        g = self._guarded(kv)
        m = self._guarded(slot_mask)
        batch, heads, slots, head_dim = kv.shape
        error = self.lib.emu_compact_kv(g.data_ptr(), kv.element_size(), batch, heads, slots, head_dim, *g.stride()[:3],
                                        m.data_ptr(), m.stride(0))
        self.check()
        if error:
            raise RuntimeError(f"compact_kv_launch returned CUDA error {error}")
        if kv.numel():
            span = 1 + sum((n - 1) * s for n, s in zip(kv.shape, kv.stride()))
            kv.as_strided((span,), (1,)).copy_(g.as_strided((span,), (1,)))

    def compact_kv(self, tensors, slot_mask):
        """``compaction_cuda.compact_kv`` on the emulated op (through ``ops.cuda_host``)."""
        compact_kv_with(self.op_compact_kv, tensors, slot_mask)

    def verify(self, target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens=None):
        """``cuda_backend.verify`` on the emulated ops."""
        return verify_with(self.op_verify, target_logits, draft_logits, draft_tokens, sampling, randomness,
                           num_draft_tokens, kth_largest=self.op_kth_largest_index)

    def sample(self, logits, sampling, randomness):
        """``cuda_backend.sample`` on the emulated ops."""
        return sample_with(self.op_sample, logits, sampling, randomness, kth_largest=self.op_kth_largest_index)


__all__ = ["EmulatedOps", "build", "cuda_include_dir", "transform", "unavailable_reason"]
