import os
import sys
import tempfile

# One intra-op thread: the test models are tiny, so their forwards are dominated by per-op overhead, and a second
# OpenMP thread only adds spin-waiting (on a loaded 2-core machine, a tiny forward went from ~5 ms to ~500 ms).
# Subprocesses started by tests inherit it. Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

sys.path.insert(0, os.path.dirname(__file__))  # the shared helpers: tests/helpers/

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be on before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # Inductor's on-disk caches do not key their C++ on the instruction set torch dispatches to: after a run on this
    # machine's AVX-512, a run with ATEN_CPU_CAPABILITY=default (how another CPU's kernels are reproduced) reused C++
    # written for at::vec and failed to compile it, and one with =avx2 computed NaN logits (both pass with an empty
    # cache). One cache per capability. (Not through torch._inductor's own default: importing it imports triton,
    # which must not happen before TRITON_INTERPRET is set.)
    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_uid{os.getuid()}_{capability}")
