"""The CUDA kernels of ``csrc/`` without a GPU: their host build (``tests/helpers/cuda_emulation``: every CUDA thread a
fiber, barriers and shuffles checked, buffers ending at an inaccessible page) run through the backend's own host code
(``ops.cuda_host``) against the checks a GPU runs (``test_kernel_edges.py``), at sizes the CPU affords.

This is how a change to ``csrc/`` is checked between GPU leases: ties across vectors, threads and the 2048-id chunk
edge, NaN/+inf flags, per-row parameters, planted winners in every race, the partial last vector and misaligned rows
(the scalar path). Skipped where there is no g++ or no CUDA toolkit headers (nvcc's); the build takes ~40 s once per
test session (shared by the xdist workers through a lock).
"""

import fcntl
import hashlib

import pytest
import torch

from helpers import cuda_emulation
from speculative_kernels.ops.randomness import Randomness
from speculative_kernels.ops.reference import sample_reference, verify_reference
from speculative_kernels.ops.sampling import GREEDY

import test_kernel_edges as edges  # (the test files are imported by name: tests/ops is on sys.path)

REASON = cuda_emulation.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"the CUDA emulation cannot be built here: {REASON}")
NAME = "cuda-emulated"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="session")
def emulated(tmp_path_factory):
    """EmulatedOps of this checkout's csrc/, built once per test session (the workers share one build)."""
    sources = sorted(cuda_emulation.CSRC.glob("*.cu*")) + sorted(cuda_emulation.CSRC.glob("*.h")) + sorted(
        cuda_emulation.HERE.glob("*.[ch]*"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    root = tmp_path_factory.getbasetemp().parent / f"cuda-emulation-{digest}"
    root.mkdir(parents=True, exist_ok=True)
    library = root / "libcuda_emulation.so"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            built = cuda_emulation.build(root / "build")
            built.rename(library)
    return cuda_emulation.EmulatedOps(library)


@pytest.fixture
def as_backend(emulated, monkeypatch):
    """test_kernel_edges' checks with ``name`` = "cuda-emulated" run the emulated CUDA backend."""
    real = edges._backend
    monkeypatch.setattr(edges, "_backend",
                        lambda name: (emulated.verify, emulated.sample) if name == NAME else real(name))
    return emulated


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_bit_exact(emulated, dtype):
    """Random logits with each row's maximum copied to another id (the first index wins), drafts mostly right: every
    row, position and the sampler equal the reference, at vocabularies around the 8-id vector and 2048-id chunk."""
    for vocab, batch, k in ((3, 3, 4), (111, 3, 1), (1000, 2, 4), (2049, 1, 2)):
        g = torch.Generator().manual_seed(vocab)
        target = torch.randn(batch, k + 1, vocab, generator=g).to(dtype)
        draft = torch.randn(batch, k, vocab, generator=g).to(dtype)
        best = target.float().argmax(-1, keepdim=True)
        target.scatter_(-1, torch.randint(0, vocab, best.shape, generator=g), target.gather(-1, best))
        best = target.float().argmax(-1)
        tokens = torch.where(torch.rand(batch, k, generator=g) < 0.8, best[:, :k],
                             torch.randint(0, vocab, (batch, k), generator=g))
        randomness = Randomness(torch.full((batch,), 3), torch.zeros(batch, dtype=torch.int64), False)
        for d in (draft, None):
            got = emulated.verify(target, d, tokens, GREEDY, randomness)
            want = verify_reference(target, d, tokens, GREEDY, randomness)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (vocab, d is None)
        assert torch.equal(emulated.sample(target[:, 0], GREEDY, randomness),
                           sample_reference(target[:, 0], GREEDY, randomness))


@pytest.mark.parametrize("vocab,layout", [(1001, "padded"), (1001, "contiguous"), (6149, "padded")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_and_planted_winners(as_backend, dtype, vocab, layout):
    """First-index ties wherever the two copies sit, -0/+0; a planted winner at every edge id, greedy and in the
    races of both sampling settings (the races at 1001 only: the CPU's time)."""
    edges._check_shortcut_ties(NAME, dtype, vocab, layout)
    edges._check_planted_greedy(NAME, dtype, vocab, layout)
    if vocab < 2048:
        for warp in edges.PLANTED_WARPS:
            edges._check_planted_races(NAME, dtype, vocab, layout, warp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_row_parameters(as_backend, dtype):
    edges._check_shortcut_row_params(NAME, dtype, 1001, "padded")


def test_invalid_value_flags(as_backend):
    """NaN / +inf beside the maximum at every edge id and all -inf rows flag the row, greedy and sampled."""
    edges._check_shortcut_flags(NAME, torch.bfloat16, 1001, "padded")


def test_exact_replay(as_backend):
    """{0, -inf} logits: the residual and bonus races agree with the reference bit for bit."""
    edges._check_exact_replay(NAME, torch.bfloat16, 64, 2, "contiguous")
