"""The CUDA kernels of ``csrc/`` without a GPU: their host build (``tests/helpers/cuda_emulation``: every CUDA thread a
fiber, barriers, shuffles and ballots checked, buffers ending at an inaccessible page) run through the backends' own
host code (``ops.cuda_host``) against the checks a GPU runs (``test_kernel_edges.py``, ``test_compaction.py``), at
sizes the CPU affords.

This is how a change to ``csrc/`` is checked between GPU leases: ties across vectors, threads and the 2048-id chunk
edge, NaN/+inf flags, per-row parameters, planted winners in every race, the partial last vector and misaligned rows
(the scalar path); for the KV-cache compaction kernel, every byte of the cache buffer against the torch reference
(row sizes around 16 bytes and the 1024-byte staging chunk, 576-wide bf16 latent rows, holes at the start, the end,
everywhere and across the 32-slot tiles, strided caches, raw bit patterns), with each block's threads run in both
orders (a missing barrier shows in one of them). Skipped where there is no g++ or no CUDA toolkit headers (nvcc's); the
build takes ~40 s once per test session (shared by the xdist workers through a lock).
"""

import fcntl
import hashlib
import os
import shutil
import subprocess
import time

import pytest
import torch

from helpers import cuda_emulation
from speculative_kernels.ops.compaction import compact_kv, compaction_lengths
from speculative_kernels.ops.randomness import Randomness
from speculative_kernels.ops.reference import sample_reference, verify_reference
from speculative_kernels.ops.sampling import GREEDY, Sampling
from speculative_kernels.ops.validation import check_sampling

import test_compaction as compaction  # (the test files are imported by name: tests/ops is on sys.path)
import test_kernel_edges as edges
import test_vocabulary_layout as layout

REASON = cuda_emulation.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"the CUDA emulation cannot be built here: {REASON}")
NAME = "cuda-emulated"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="session")
def emulated(tmp_path_factory):
    """EmulatedOps of this checkout's csrc/, built once per test session (the workers share one build). The build is
    keyed by every file it is made from (csrc/'s and the emulation's own, its transform and flags included: a key of
    the C++ sources alone ran a stale build after a change of the transform), the compiler's version and the CUDA
    headers' folder. Builds of other keys unused for a day are removed (they accumulated, ~1 MB each)."""
    sources = [p for folder in (cuda_emulation.CSRC, cuda_emulation.HERE) for p in sorted(folder.iterdir())
               if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".cpp", ".py")]
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout
    key = b"".join(p.name.encode() + p.read_bytes() for p in sources) + compiler.encode() + str(
        cuda_emulation.cuda_include_dir()).encode()
    parent = tmp_path_factory.getbasetemp().parent
    root = parent / f"cuda-emulation-{hashlib.sha256(key).hexdigest()[:16]}"
    root.mkdir(parents=True, exist_ok=True)
    os.utime(root)  # (in use: kept)
    for old in parent.glob("cuda-emulation-*"):
        if old != root and time.time() - old.stat().st_mtime > 86400:
            shutil.rmtree(old, ignore_errors=True)
    library = root / "libcuda_emulation.so"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            built = cuda_emulation.build(root / "build", cuda_emulation.CSRC)
            built.rename(library)
    return cuda_emulation.EmulatedOps(library)


@pytest.fixture(params=["split", "fused"])
def as_backend(request, emulated, monkeypatch):
    """test_kernel_edges' checks with ``name`` = "cuda-emulated" run the emulated CUDA backend, with the sampling
    passes split (chunk_stats, decide, race, finalize) and fused (chunk_stats, decide_race) at every batch size."""
    real = edges._backend
    monkeypatch.setenv(edges.PASSES_VARIABLE, request.param)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_residual_fallback(as_backend, dtype):
    """Every residual 0 (q == p, a draft token outside the top-k): the race over p, bit for bit."""
    edges._check_zero_residual_fallback(NAME, dtype, 1001, "padded")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_residual_without_a_cut(as_backend, dtype):
    """Every residual 0 and no cut (q == p; a one-hot q on a one-hot p): the race over p at every id, bit for bit."""
    edges._check_zero_residual_without_a_cut(NAME, dtype, 1001, "padded", temperatures=(0.8,))


def test_exact_replay(as_backend):
    """{0, -inf} logits: the residual and bonus races agree with the reference bit for bit."""
    edges._check_exact_replay(NAME, torch.bfloat16, 64, 2, "contiguous")


@pytest.mark.parametrize("vocab,stride,seed_per_row", layout.LAYOUT_CASES, ids=str)
def test_races_draw_the_vocabulary_layout(as_backend, vocab, stride, seed_per_row):
    """A group of four ids shares a Philox call: the vector path (aligned rows, bf16's 8-id and float32's 4-id
    vectors, the partial last vector) and the scalar path (odd strides) give id v word v % 4 of the call at v // 4."""
    dtype = torch.bfloat16 if vocab % 2 else torch.float32
    layout.check_races_draw_the_layout(as_backend.verify, as_backend.sample, vocab, stride, seed_per_row, dtype)


def test_the_only_token_of_positive_probability_wins_even_at_the_largest_philox_words(emulated):
    """test_sampling_boundaries' case on the CUDA kernels: id 7 alone has a positive probability and its Philox word
    made u round to 1 (E = +inf, key 0, tied with the cut ids' 0: id 0 was drawn), top-k and top-p."""
    import test_sampling_boundaries as boundaries

    seed, hot = boundaries.INFINITE_E_SEED, boundaries.INFINITE_E_ID
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(0))
    logits[0, hot] = 10.0
    randomness = Randomness(torch.tensor([seed]), torch.tensor([0]), True)
    for sampling in (Sampling(1.0, 1, 1.0), Sampling(1.0, 0, 0.5)):
        assert emulated.sample(logits, sampling, randomness).tolist() == [hot]
        want = sample_reference(logits, sampling, randomness)
        assert torch.equal(emulated.sample(logits, sampling, randomness), want)


@pytest.fixture
def blocks_last_first(emulated):
    emulated.set_reverse_blocks(True)
    yield
    emulated.set_reverse_blocks(False)


def test_races_with_blocks_last_first(as_backend, blocks_last_first):
    """A GPU runs a grid's blocks in any order, so any race block of a row may take the fused pass's last ticket and
    combine the partials: here they run last-first (chunk 0 combines), planted winners and the zero-residual
    fallback over two 512-id chunks still bit for bit (the emulation cannot show memory ordering, only the order)."""
    edges._check_planted_races(NAME, torch.float32, 1001, "padded", edges.PLANTED_WARPS[1])
    edges._check_zero_residual_fallback(NAME, torch.float32, 1001, "padded", batch=4)


@pytest.fixture
def as_single_backend(emulated, monkeypatch):
    """test_kernel_edges' checks on the emulated CUDA backend with every pass in one kernel (single_pass_kernel,
    SPECULATIVE_KERNELS_VERIFY_PASSES=single), greedy and sampling."""
    real = edges._backend
    monkeypatch.setenv(edges.PASSES_VARIABLE, "single")
    monkeypatch.setattr(edges, "_backend",
                        lambda name: (emulated.verify, emulated.sample) if name == NAME else real(name))
    return emulated


def test_single_pass_kernel(as_single_backend):
    """The one-kernel structure (built for bf16 logits without a cut) against the reference: planted greedy winners
    at the 2048-id chunk edges (B = 8, three chunks), planted race winners at the 512-id race-chunk edges, every
    residual 0 (the race over p at every id, B = 4), NaN/+inf rows flagged, the exact residual and bonus races at
    B = 1 (verify, and the sampler: K = 0), and greedy and sampled rows of one per-row launch. Every call runs on a
    fresh workspace full of garbage, so counters the launch did not zero show. Its blocks take their work in claim
    order, so the order the emulation runs them in cannot matter (the kernel never reads blockIdx): no last-first
    run."""
    emulated = as_single_backend
    edges._check_planted_greedy(NAME, torch.bfloat16, 6149, "padded")
    edges._check_planted_races(NAME, torch.bfloat16, 1001, "padded", edges.PLANTED_WARPS[0])
    edges._check_zero_residual_without_a_cut(NAME, torch.bfloat16, 1001, "padded", batch=4, temperatures=(0.8,))
    edges._check_shortcut_flags(NAME, torch.bfloat16, 1001, "padded", warps=edges.SHORTCUT_WARPS[3:4])
    edges._check_exact_replay(NAME, torch.bfloat16, 1, 64, "contiguous", warps=edges.EXACT_WARPS[:2])
    batch, k, vocab = 4, 2, 1001
    target, draft, g = _host_logits(batch, k, vocab, seed=9)
    target, draft = target.bfloat16(), draft.bfloat16()
    tokens = torch.randint(0, vocab, (batch, k), generator=g)
    tokens[:, 0] = target[:, 0].float().argmax(-1)  # (some acceptance)
    sampling = check_sampling(torch.tensor([0.0, 0.8, 1.0, 0.0]), 0, 1.0, batch, torch.device("cpu"))  # (no cut)
    for d in (draft, None):
        before = emulated.stream_ops()
        got = emulated.verify(target, d, tokens, sampling, _host_randomness(batch))
        assert [b - a for a, b in zip(before, emulated.stream_ops())] == [1, 1]  # (the single kernel ran)
        _same_outputs(got, verify_reference(target, d, tokens, sampling, _host_randomness(batch)))


# Stream operations (kernel launches, memsets) per call of each structure: (greedy, sampling) for B = 1 and B = 8 at
# V = 64 in bf16 (B x V <= 131072: the fused sampling pass by default); float32 under "single": the default's.
STREAM_OPS = {"": ((2, 0), (2, 0)), "split": ((2, 0), (4, 0)), "fused": ((2, 0), (2, 0)), "single": ((1, 1), (1, 1)),
              "single-float32": ((2, 0), (2, 0))}


@pytest.mark.parametrize("passes", list(STREAM_OPS), ids=lambda p: p or "default")
def test_stream_operations_per_call(emulated, monkeypatch, passes):
    """(kernel launches, memsets) of one verify or sample call, deterministic: greedy is chunk_stats + decide, or the
    single kernel; sampling adds race + finalize (split), fuses them with the decision (fused), or is the single
    kernel after a memset of its counters (bf16 only: float32 logits keep the default structure). With and without
    draft logits, at B = 1 and 8."""
    monkeypatch.setenv(edges.PASSES_VARIABLE, passes.removesuffix("-float32"))
    dtype = torch.float32 if passes.endswith("-float32") else torch.bfloat16
    greedy_ops, sampling_ops = STREAM_OPS[passes]
    for batch in (1, 8):
        target, draft, g = _host_logits(batch, 2, 64, seed=batch)
        target, draft = target.to(dtype), draft.to(dtype)
        tokens = torch.randint(0, 64, (batch, 2), generator=g)
        for sampling, want in ((GREEDY, greedy_ops), (Sampling(0.8, 0, 1.0), sampling_ops)):
            calls = [lambda: emulated.verify(target, draft, tokens, sampling, _host_randomness(batch)),
                     lambda: emulated.verify(target, None, tokens, sampling, _host_randomness(batch)),
                     lambda: emulated.sample(target[:, 0], sampling, _host_randomness(batch))]
            for call in calls:
                before = emulated.stream_ops()
                call()
                after = emulated.stream_ops()
                assert (after[0] - before[0], after[1] - before[1]) == want, (batch, sampling)


# ------------------------------------------------------------------------------------------ compact_kv (rollback)
def _bits(t):
    return t.contiguous().view(torch.uint8)


_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_compaction(emulated, buffer, views, mask, as_bits=False):
    """Compacts ``views(copy of buffer)`` (a list of [B, H, S, D] tensors over it) with the emulated CUDA op, threads
    first-first and last-first, and with the torch reference; every byte of the buffer must agree (slots outside the
    views and the elements between their rows included), and the real-slot counts. as_bits: the reference runs on the
    buffer seen as integers of the same width (torch's CPU gather rewrites fp16 / bf16 NaNs)."""
    want = buffer.clone()
    want_lengths = compact_kv(views(want.view(_AS_INT[want.element_size()]) if as_bits else want), mask,
                              backend="torch")
    assert torch.equal(want_lengths, compaction_lengths(mask))
    for reverse in (False, True):
        got = buffer.clone()
        emulated.set_reverse_order(reverse)
        try:
            emulated.compact_kv(views(got), mask)
        finally:
            emulated.set_reverse_order(False)
        assert torch.equal(_bits(got), _bits(want)), f"threads {'last' if reverse else 'first'}-first"


def _plain(buffer):
    return [buffer]


@pytest.mark.parametrize("size", compaction.SIZES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compact_kv_bit_exact(emulated, dtype, size):
    """test_compaction's GPU cases: a view of a longer slot buffer (7 slots past it), a row without holes and a
    left-padded row, partial tiles, S = 1, D = 1."""
    buffer, kv, mask = compaction._case(*size, dtype, seed=3)
    slots = kv.shape[2]
    _check_compaction(emulated, buffer, lambda b: [b[:, :, :slots]], mask)


@pytest.mark.parametrize("size,dtype", [((2, 1, 70, 576), torch.bfloat16), ((1, 2, 45, 1000), torch.float32),
                                        ((1, 1, 40, 2100), torch.float16), ((3, 2, 97, 576), torch.bfloat16)],
                         ids=str)
def test_compact_kv_rows_wider_than_one_staging_chunk(emulated, size, dtype):
    """Slot rows over the kernel's 1024-byte staging chunk: a 576-wide bf16 latent row (1152 bytes: a 1024-byte chunk
    and a 128-byte one), a partial last chunk, several chunks."""
    buffer, kv, mask = compaction._case(*size, dtype, seed=13)
    slots = kv.shape[2]
    _check_compaction(emulated, buffer, lambda b: [b[:, :, :slots]], mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compact_kv_row_bytes_around_vectors_and_the_chunk(emulated, dtype):
    """Slot rows of 16 +- 1 element, and 1024 / 2048 bytes +- 1 element (one chunk exactly, one element into the
    next), two rows and two heads, holes everywhere."""
    size = torch.tensor([], dtype=dtype).element_size()
    for row_bytes in (16, 1024, 2048):
        for delta in (-1, 0, 1):
            head_dim = row_bytes // size + delta
            buffer, kv, mask = compaction._case(2, 2, 37, head_dim, dtype, seed=row_bytes + delta)
            slots = kv.shape[2]
            _check_compaction(emulated, buffer, lambda b: [b[:, :, :slots]], mask)


def _hole_patterns(slots):
    """Masks [1, S] (name, row): holes at the start, at the end, everywhere, none, all, a single real slot first or
    last, one hole in the second 32-slot tile, a full first tile then holes, random sparse and dense rows."""
    s = torch.arange(slots)
    g = torch.Generator().manual_seed(slots)
    rows = {
        "start": s >= slots // 3, "end": s < slots - slots // 3, "alternate": s % 2 == 0, "alternate-odd": s % 2 == 1,
        "all-real": torch.ones(slots, dtype=torch.bool), "no-real": torch.zeros(slots, dtype=torch.bool),
        "last-only": s == slots - 1, "first-only": s == 0, "hole-in-tile-2": s != min(40, slots - 1),
        "tile-then-holes": (s < 32) | (s % 3 == 0), "sparse": torch.rand(slots, generator=g) < 0.1,
        "dense": torch.rand(slots, generator=g) < 0.9,
    }
    return rows


@pytest.mark.parametrize("slots", [1, 31, 32, 33, 65, 100])
def test_compact_kv_hole_patterns_batch_one_and_several_rows(emulated, slots):
    """Every hole pattern alone (batch 1) and all of them as the rows of one batch (each row its own count), bf16,
    D = 9 (a partial 16-byte vector), 2 heads."""
    patterns = _hole_patterns(slots)
    g = torch.Generator().manual_seed(100 + slots)
    for name, row in patterns.items():
        buffer = torch.randn(1, 2, slots + 3, 9, generator=g).to(torch.bfloat16)
        _check_compaction(emulated, buffer, lambda b: [b[:, :, :slots]], row.to(torch.int64)[None])
    mask = torch.stack(list(patterns.values())).to(torch.uint8) * 3  # nonzero = real, any integer dtype
    buffer = torch.randn(mask.shape[0], 2, slots, 9, generator=g).to(torch.bfloat16)
    _check_compaction(emulated, buffer, _plain, mask)


def test_compact_kv_strided_caches(emulated):
    """Caches that are views: [B, S, H, D] memory seen as [B, H, S, D] (heads inside a slot), D a slice of a wider
    row, every other batch row, a slice of the heads, and K and V interleaved in one buffer (two tensors of one list
    over the same memory, disjoint elements); 576-wide bf16 and 5-wide fp32."""
    g = torch.Generator().manual_seed(7)
    for dtype, head_dim in ((torch.bfloat16, 576), (torch.float32, 5)):
        batch, heads, slots = 4, 3, 45
        mask = (torch.rand(batch, slots, generator=g) < 0.6).to(torch.int64)
        mask[1, :20] = 0
        bshd = torch.randn(batch, slots + 2, heads, head_dim, generator=g).to(dtype)
        _check_compaction(emulated, bshd, lambda b: [b[:, :slots].transpose(1, 2)], mask)
        wide = torch.randn(batch, heads, slots, head_dim + 6, generator=g).to(dtype)
        _check_compaction(emulated, wide, lambda b: [b[..., 3 : 3 + head_dim]], mask)
        every_other = torch.randn(2 * batch, heads, slots, head_dim, generator=g).to(dtype)
        _check_compaction(emulated, every_other, lambda b: [b[::2]], mask)
        some_heads = torch.randn(batch, heads + 2, slots, head_dim, generator=g).to(dtype)
        _check_compaction(emulated, some_heads, lambda b: [b[:, 1 : 1 + heads]], mask)
        kv_pair = torch.randn(batch, slots, 2, heads, head_dim, generator=g).to(dtype)
        _check_compaction(emulated, kv_pair,
                          lambda b: [b[:, :, 0].transpose(1, 2), b[:, :, 1].transpose(1, 2)], mask)


def test_compact_kv_several_tensors_and_edge_densities(emulated):
    """test_compaction's densities 0, 1, 0.05, 0.95 over three tensors sharing one mask, and over two of other head
    sizes (a latent cache's keys and values)."""
    for density in (0.0, 1.0, 0.05, 0.95):
        _, _, mask = compaction._case(3, 2, 70, 16, torch.float32, density=density, seed=11)
        if density == 0.0:
            mask.zero_()
        buffer = torch.randn(3, 3, 2, 70, 16, generator=torch.Generator().manual_seed(11))
        _check_compaction(emulated, buffer, lambda b: list(b.unbind(1)), mask)
        # a latent cache's keys and values of other head sizes (here the two column ranges of each row's slots)
        _check_compaction(emulated, buffer[:, 0, :1], lambda b: [b[..., :10], b[..., 10:]], mask)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64, torch.int8, torch.float8_e4m3fn], ids=str)
def test_compact_kv_raw_bit_patterns(emulated, dtype):
    """Random bytes (NaNs with payloads, signaling NaNs, -0, subnormals, infinities) move unchanged, for every element
    size the kernel has (1, 2, 4 and 8 bytes); the reference moves the same bytes as integers."""
    size = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(size)
    raw = torch.randint(0, 256, (3 * 2 * 40 * 24 * size,), dtype=torch.uint8, generator=g)
    buffer = raw.view(dtype).view(3, 2, 40, 24)
    mask = torch.rand(3, 40, generator=g) < 0.5
    _check_compaction(emulated, buffer, _plain, mask, as_bits=True)


def test_compact_kv_empty_sizes(emulated):
    """Zero rows, heads, slots or columns: nothing to do, no launch error."""
    for shape in ((0, 2, 5, 4), (2, 0, 5, 4), (2, 2, 0, 4), (2, 2, 5, 0)):
        buffer = torch.randn(*shape)
        mask = torch.ones(shape[0], shape[2], dtype=torch.int64)
        _check_compaction(emulated, buffer, _plain, mask)


def test_compact_kv_op_with_a_strided_mask(emulated):
    """The op itself (as torch.ops.speculative_kernels_cuda.compact_kv_ takes it) with an int8 mask whose rows are a
    view of wider rows (the binding requires unit stride over slots only): each row reads its own mask row."""
    g = torch.Generator().manual_seed(5)
    wide = (torch.rand(3, 50, generator=g) < 0.5).to(torch.int8)
    mask = wide[:, 3:43]
    buffer = torch.randn(3, 2, 40, 7, generator=g)
    want = buffer.clone()
    compact_kv(want, mask, backend="torch")
    emulated.op_compact_kv(buffer, mask)
    assert torch.equal(_bits(buffer), _bits(want))

# The host side (``ops/cuda_host.py``) on cases the kernel-edge checks above do not make: their sampling rows are 0
# at a tied pair and -inf elsewhere, so a wrong cut source keeps the same elements, no case verifies drafts with a
# cut or a per-row parameter out of range, and the compaction masks are 0/1 with ordinary strides (mutation round 4:
# mutants of cuda_host.py that passed every test; each case fails on one).


def _host_randomness(batch):
    return Randomness(torch.tensor([b * 7919 + 17 for b in range(batch)]), torch.full((batch,), 3), False)


def _host_logits(batch, k, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, k + 1, vocab, generator=g) * 3, torch.randn(batch, k, vocab, generator=g) * 3, g


def _same_outputs(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b), f"\n{a}\n!=\n{b}"


@pytest.mark.parametrize("warp", [(0.7, 50, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.9, 20, 0.9)], ids=str)
def test_scalar_cuts_on_random_logits(emulated, warp):
    """top-k alone (H2) and any cut with a draft's logits (H4): verify with and without q, and sample."""
    batch, k, vocab = 6, 3, 1001
    target, draft, g = _host_logits(batch, k, vocab, seed=1)
    sampling = Sampling(*warp)
    tokens = torch.randint(0, vocab, (batch, k), generator=g)
    tokens[:, 0] = target[:, 0].argmax(-1)  # (some acceptance)
    for d in (draft, None):
        _same_outputs(emulated.verify(target, d, tokens, sampling, _host_randomness(batch)),
                      verify_reference(target, d, tokens, sampling, _host_randomness(batch)))
    _same_outputs([emulated.sample(target[:, 0], sampling, _host_randomness(batch))],
                  [sample_reference(target[:, 0], sampling, _host_randomness(batch))])


def test_per_row_rows_without_a_cut_and_out_of_range_rows(emulated):
    """Per-row parameters on random logits: rows without any cut beside rows with one (H1: their source must be
    their minimum), and a row whose top_p is out of range, flagged -1 in tokens and num_accepted (H3)."""
    batch, k, vocab = 6, 2, 1001
    target, draft, g = _host_logits(batch, k, vocab, seed=2)
    t = torch.tensor([1.0, 0.8, 0.0, 1.2, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 0, 10, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.9, 1.5], dtype=torch.float64)  # row 5: out of range
    sampling = check_sampling(t, top_k, top_p, batch, torch.device("cpu"))
    tokens = torch.randint(0, vocab, (batch, k), generator=g)
    for d in (draft, None):
        got = emulated.verify(target, d, tokens, sampling, _host_randomness(batch))
        _same_outputs(got, verify_reference(target, d, tokens, sampling, _host_randomness(batch)))
        assert got[1][5] == -1 and (got[0][5] == -1).all()
    _same_outputs([emulated.sample(target[:, 0], sampling, _host_randomness(batch))],
                  [sample_reference(target[:, 0], sampling, _host_randomness(batch))])


def _host_compaction_case(mask):
    g = torch.Generator().manual_seed(3)
    b, s = mask.shape
    kv = torch.randn(b, 2, s, 8, generator=g)
    want, got = kv.clone(), kv.clone()
    compact_kv([want], mask, backend="torch")
    return got, want


def test_compaction_mask_values_other_than_one(emulated):
    """nonzero = real (compaction.py): -1 and 256 are real slots (H5, H6)."""
    mask = torch.tensor([[0, 1, -1, 0, 256, 1, 0, 2], [256, 0, 0, -1, 1, 0, 1, 1]])
    got, want = _host_compaction_case(mask)
    emulated.compact_kv([got], mask)
    assert torch.equal(got, want)


def test_compaction_with_a_transposed_mask(emulated):
    """A [B, S] mask that is the transpose of an [S, B] tensor (H7: the host side makes it contiguous)."""
    mask = torch.tensor([[1, 0, 1, 1, 0, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0, 1, 1, 1]]).t().contiguous().t()
    assert not mask.is_contiguous()
    got, want = _host_compaction_case(mask)
    emulated.compact_kv([got], mask)
    assert torch.equal(got, want)


def _element_cut_always(logits, sampling, kth_largest):
    """``cuda_host._cut`` by the float32 element cut whatever the sampling (no k-th largest select)."""
    from speculative_kernels.ops import cuda_host

    return cuda_host._element_cut(logits, sampling)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("warp", [(1.0, 1, 1.0), (0.7, 2, 1.0), (1e-3, 5, 1.0), (0.7, 60, 1.0)], ids=str)
def test_top_k_cut_from_the_raw_logits_gives_the_element_cuts_outputs(emulated, monkeypatch, dtype, warp):
    """``cuda_host._top_k_cut`` (one topk over the raw logits) against ``_element_cut`` (the float32 z path) through
    the ops: tied logits with +-inf and a NaN row (flagged either way), k = 1 and k = V - 1, verify with and without
    q, and sample; the tokens and counts are the same."""
    from speculative_kernels.ops import cuda_host
    from test_cuda_host_cut import tied_logits

    batch, k, vocab = 8, 2, 61
    target = tied_logits((batch, k + 1, vocab), dtype, seed=4, stride=k + 1)  # (special rows: batch rows 1-7)
    draft = tied_logits((batch, k, vocab), dtype, seed=5, stride=k)
    tokens = target[:, :k].float().nan_to_num().argmax(-1)
    sampling = Sampling(*warp)

    def outputs():
        return [*emulated.verify(target, draft, tokens, sampling, _host_randomness(batch)),
                *emulated.verify(target, None, tokens, sampling, _host_randomness(batch)),
                emulated.sample(target[:, 0], sampling, _host_randomness(batch))]

    fast = outputs()
    monkeypatch.setattr(cuda_host, "_cut", _element_cut_always)
    _same_outputs(fast, outputs())
    assert fast[1][7] == -1 and fast[3][7] == -1 and fast[4][7] == -1  # (the NaN row: flagged)
    assert (fast[1] >= 0).sum() >= 3 and (fast[4] >= 0).sum() >= 3  # (valid rows with a cut remain)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("warp", [(1.0, 1, 0.5), (0.7, 5, 0.9), (1e-3, 20, 0.3), (0.7, 60, 0.9999999)], ids=str)
def test_top_k_top_p_cut_gives_the_whole_vocabulary_cuts_outputs(emulated, monkeypatch, dtype, warp):
    """``cuda_host._top_k_top_p_cut`` (a topk of k) against ``_element_cut`` over the whole-vocabulary definition
    (a V-length sort) through the ops, and against the reference: tied logits with +-inf, overflow and a NaN row
    (flagged), k = 1 and V - 1, verify with and without q, and sample."""
    from speculative_kernels.ops import cuda_host
    from test_cuda_host_cut import tied_logits
    from test_top_k_top_p_cut import whole_vocabulary_cut

    batch, k, vocab = 8, 2, 61
    target = tied_logits((batch, k + 1, vocab), dtype, seed=6, stride=k + 1)
    draft = tied_logits((batch, k, vocab), dtype, seed=7, stride=k)
    tokens = target[:, :k].float().nan_to_num().argmax(-1)
    sampling = Sampling(*warp)

    def outputs(verify, sample):
        return [*verify(target, draft, tokens, sampling, _host_randomness(batch)),
                *verify(target, None, tokens, sampling, _host_randomness(batch)),
                sample(target[:, 0], sampling, _host_randomness(batch))]

    fast = outputs(emulated.verify, emulated.sample)
    _same_outputs(fast, outputs(verify_reference, sample_reference))
    monkeypatch.setattr(cuda_host, "_cut", _element_cut_always)
    monkeypatch.setattr(cuda_host, "warp_thresholds", whole_vocabulary_cut)
    _same_outputs(fast, outputs(emulated.verify, emulated.sample))
    assert fast[1][7] == -1 and fast[3][7] == -1 and fast[4][7] == -1  # (the NaN row: flagged)
    assert (fast[1] >= 0).sum() >= 3 and (fast[4] >= 0).sum() >= 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_row_cut_from_a_host_bound_gives_the_sorted_cuts_outputs(emulated, monkeypatch, dtype):
    """Per-row top-k with top-p and a host bound of top_k (``RowSampling.top_k_bound``: one topk of the bound in
    ``cuda_host``) against the same rows without it (a V-length sort per row) and the reference: tied logits with
    +-inf, overflow and a NaN row, a greedy row, a top-k-alone row."""
    import dataclasses
    from test_cuda_host_cut import tied_logits

    batch, k, vocab = 8, 2, 61
    target = tied_logits((batch, k + 1, vocab), dtype, seed=11, stride=k + 1)
    draft = tied_logits((batch, k, vocab), dtype, seed=12, stride=k)
    tokens = target[:, :k].float().nan_to_num().argmax(-1)
    t = torch.tensor([0.7, 1.0, 0.0, 1e-3, 1.3, 0.7, 1.0, 0.8])
    top_k = torch.tensor([1, 5, 0, 20, 12, 3, 20, 7])
    top_p = torch.tensor([0.5, 0.9, 0.3, 0.3, 1.0, 1e-9, 0.9999999, 0.9], dtype=torch.float64)
    sorted_rows = check_sampling(t, top_k, top_p, batch, torch.device("cpu"))
    bounded = dataclasses.replace(sorted_rows, rows=dataclasses.replace(sorted_rows.rows, top_k_bound=20))

    def outputs(verify, sample, sampling):
        return [*verify(target, draft, tokens, sampling, _host_randomness(batch)),
                *verify(target, None, tokens, sampling, _host_randomness(batch)),
                sample(target[:, 0], sampling, _host_randomness(batch))]

    from speculative_kernels.ops import cuda_host

    bounds, real = [], cuda_host.row_thresholds
    monkeypatch.setattr(cuda_host, "row_thresholds", lambda *a: bounds.append(a[3]) or real(*a))
    got = outputs(emulated.verify, emulated.sample, bounded)
    assert bounds == [20] * 4  # (the bound reaches every cut: target and draft, target alone, the sample)
    _same_outputs(got, outputs(emulated.verify, emulated.sample, sorted_rows))
    _same_outputs(got, outputs(verify_reference, sample_reference, bounded))
    assert got[1][7] == -1 and (got[1] >= 0).sum() >= 3


# ---- the k-th largest select of the top-k cut (csrc/topk_kernels.cu) ------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kth_largest_select(emulated, dtype):
    """The radix select against torch.topk's k-th value (test_kth_largest_select.check_select): ties, lower-digit
    decisions, every bit pattern, +-inf, -0/+0, all-equal and NaN rows, k from 1 to V, [B, J, V] views and [B, V],
    a row over 1, 3 and 5 blocks (chunks of 8-aligned ids, a partial last one), blocks run in both orders.
    Every k on the contiguous [B, J, V], k = V - 1 on the two strided views: ~1 s per dtype."""
    import test_kth_largest_select as select

    try:
        for vocab, blocks in [(1, 1), (13, 3), (203, 5)]:
            emulated.select_blocks_per_row = blocks
            emulated.set_reverse_blocks(vocab == 203)
            for name, x in select.logit_cases(2, 3, vocab, dtype, seed=vocab):
                (_, contiguous), *views = select.strided_views(x)
                for k in select.ks(vocab):
                    select.check_select(emulated.op_kth_largest_index, contiguous, k)
                for _, view in views:
                    select.check_select(emulated.op_kth_largest_index, view, max(vocab - 1, 1))
                select.check_select(emulated.op_kth_largest_index, x[:, 1], max(vocab // 3, 1))
    finally:
        emulated.select_blocks_per_row = None
        emulated.set_reverse_blocks(False)
