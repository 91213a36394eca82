import os
import sys

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
