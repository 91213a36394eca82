import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # the tiny-model factories in tests/models.py

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be on before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")
