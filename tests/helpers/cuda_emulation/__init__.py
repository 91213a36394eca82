"""The CUDA kernels of ``csrc/`` run on the CPU: a host build of the unmodified ``verify_kernels.cu`` in which every CUDA
thread is a fiber, so the GPU tests' own checks can run where no GPU is (this project's usual machine).

``build(out_dir)`` compiles it (g++ and the CUDA toolkit's headers; ~40 s): ``transform`` rewrites only the four
kernel launches (``kernel<<<grid, block, 0, stream>>>(params)`` -> ``emu::launch``) and ``cudaGetLastError()``;
``shim.h`` (included before every source) maps the CUDA keywords and intrinsics onto the host: ``__shared__`` is
``static`` (one block runs at a time), the ``_rn`` intrinsics are IEEE float operations, ``max.NaN.f32`` takes the
sources' portable branch; ``runtime.cpp`` runs each block's threads as fibers: ``__syncthreads`` and full-mask warp
shuffles are real rendezvous points, and a barrier reached at different lines or after some threads exited, a shuffle
with an exited lane, a partial mask or a deadlock is an error (``EmulatedOps.check``). ``capi.cpp`` is the C entry
point the ops below call through ctypes.

``EmulatedOps`` mirrors ``bindings.cpp`` (unit stride over V, mixed dtypes promoted to float32, contiguous cut and
per-row tensors, the workspace) and copies every tensor it passes into memory whose end touches an inaccessible page,
keeping its strides and its 16-byte alignment, so a read past a buffer faults. ``verify`` / ``sample`` are
``cuda_backend``'s, through ``ops.cuda_host`` with these ops in place of ``torch.ops.speculative_kernels_cuda``.

What it cannot show: the real NaN-propagating max instructions (their documented semantics are emulated), CUDA's
``expf`` (glibc's is used: the softmax sum may differ by an ulp), anything about timing, occupancy or memory ordering
across blocks. A GPU run still validates the kernels; this catches index, tie-break, barrier and shuffle errors first.
"""

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from speculative_kernels.ops.cuda_host import sample_with, verify_with

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[2] / "csrc"
# torch's extension builder's nvcc flags that change what the sources mean (no implicit half/bf16 conversions)
TORCH_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
               "-D__CUDA_NO_HALF2_OPERATORS__")
# IEEE arithmetic as the kernels' (no fused multiply-adds the source does not write, no fast math)
CXX_FLAGS = ("-std=c++20", "-O2", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-U_FORTIFY_SOURCE",
             "-Wno-comment", "-Wno-unknown-pragmas", "-Wno-class-memaccess")
_LAUNCH = re.compile(r"(\w+(?:<[^;<>]*>)?)<<<([^,]+),\s*([^,]+),\s*0,\s*stream>>>\((\w+)\);")
LAUNCHES = 4  # verify_kernels.cu's kernel launches (a new one must be counted here)
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
    if cuda_include_dir() is None:
        return "no CUDA toolkit headers (cuda_bf16.h under CUDA_HOME, nvcc's toolkit or /usr/local/cuda)"
    return None


def transform(source: str) -> str:
    """verify_kernels.cu -> host C++: each launch becomes ``::emu::launch``; ``cudaGetLastError()`` -> cudaSuccess."""
    host, n = _LAUNCH.subn(lambda m: f"::emu::launch([&] {{ {m.group(1)}({m.group(4)}); }}, dim3({m.group(2)}), "
                                     f"dim3({m.group(3)}));", source)
    if n != LAUNCHES:
        raise RuntimeError(f"expected {LAUNCHES} kernel launches of the form kernel<<<grid, block, 0, stream>>>(params)"
                           f" in verify_kernels.cu, found {n}: update tests/helpers/cuda_emulation")
    return host.replace("cudaGetLastError()", "cudaSuccess")


def build(out_dir: Path, csrc: Path = CSRC) -> Path:
    """Compile the emulation of ``csrc`` into ``out_dir``; returns the shared library's path. RuntimeError with the
    compiler's output if a unit does not compile."""
    out_dir.mkdir(parents=True, exist_ok=True)
    host = out_dir / "verify_kernels_host.cpp"
    host.write_text(transform((csrc / "verify_kernels.cu").read_text()))
    flags = [*CXX_FLAGS, f"-I{cuda_include_dir()}", f"-I{csrc}", "-include", str(HERE / "shim.h"), *TORCH_FLAGS]
    units = [host, HERE / "runtime.cpp", HERE / "capi.cpp"]
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
        lib.emu_errors.restype = i32
        self._buffers = []  # guarded copies stay mapped while the ops' results may still view them (small tests)

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
        ws = g(torch.empty(max(ws_bytes, 1), dtype=torch.uint8))
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
        ws = g(torch.empty(max(ws_bytes, 1), dtype=torch.uint8))
        p = self._ptr
        error = self.lib.emu_sample(DTYPES[x.dtype], p(x), batch, vocab, x.stride(0), float(temperature), p(r), p(cs),
                                    p(ci), p(s), s.stride(0), p(o), o.stride(0), int(bool(seed_per_row)), p(out),
                                    p(ws), ws_bytes)
        self.check()
        if error:
            raise RuntimeError(f"sample_launch returned CUDA error {error}")
        return out.clone()

    def verify(self, target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens=None):
        """``cuda_backend.verify`` on the emulated ops."""
        return verify_with(self.op_verify, target_logits, draft_logits, draft_tokens, sampling, randomness,
                           num_draft_tokens)

    def sample(self, logits, sampling, randomness):
        """``cuda_backend.sample`` on the emulated ops."""
        return sample_with(self.op_sample, logits, sampling, randomness)


__all__ = ["EmulatedOps", "build", "cuda_include_dir", "transform", "unavailable_reason"]
