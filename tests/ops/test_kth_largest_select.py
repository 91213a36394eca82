"""The CUDA backend's k-th largest select (``torch.ops.speculative_kernels_cuda.kth_largest_index``,
``csrc/topk_kernels.cu``: a multi-block radix select over the raw logits' bits), the element ``cuda_host._top_k_cut``
takes as the top-k cut, against torch.topk's k-th value.

Contract checked (``check_select``): the chosen element's value equals ``torch.topk``'s k-th largest (as floats: -0
and +0 are the same value), and it is the smallest id of the row holding those exact bits (the kernel's atomicMin
makes it deterministic whatever the grid). Rows with a NaN get an unspecified element (the verification kernels flag
them), so there only the id's range is checked.

``logit_cases`` are the inputs, shared by the GPU tests here (full vocabulary, real op, skipped without CUDA) and the
CPU build of the kernel (``test_cuda_emulated.py``: small vocabularies, a row spread over several blocks): ties across
blocks and across the 8-bit digits (bit patterns equal in their high bytes), +-inf, -0/+0, all-equal rows, every bit
pattern, k = 1, 2, V // 2, V - 1 and V, V not a multiple of 8 or of the chunk, and [B, J, V] views of wider buffers as
the backend passes the target's and the draft's logits.
"""


import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: (torch.int32, 32), torch.float16: (torch.int16, 16), torch.bfloat16: (torch.int16, 16)}
gpu = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device (test_cuda_emulated.py runs the CPU build)")


def ks(vocab: int) -> list[int]:
    return sorted({1, min(2, vocab), max(vocab // 2, 1), max(vocab - 1, 1), vocab})


def check_select(select, logits: torch.Tensor, k: int) -> None:
    """select(logits [B, J, V] or [B, V], k) -> ids [B, J] / [B]: each a smallest id holding the k-th largest."""
    got = select(logits, k)
    assert got.shape == logits.shape[:-1], (got.shape, logits.shape)
    ids = got.to(torch.int64)
    x = logits
    vocab = x.shape[-1]
    assert ((ids >= 0) & (ids < vocab)).all(), ids
    nan_rows = x.isnan().any(-1)
    want = torch.topk(x.float(), k, dim=-1).values[..., -1]
    value = x.float().gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    same = (value == want) | nan_rows
    assert same.all(), f"k={k}: ids {ids[~same]} hold {value[~same]}, the k-th largest is {want[~same]}"
    int_dtype = BITS[x.dtype][0]
    bits = x.view(int_dtype)
    chosen = bits.gather(-1, ids.unsqueeze(-1))
    first = (bits == chosen).to(torch.int8).argmax(-1)  # the smallest id with the chosen bits
    assert torch.equal(torch.where(nan_rows, ids, first), ids), f"k={k}: not the smallest id of its bits"


def _from_bits(bits: torch.Tensor, dtype) -> torch.Tensor:
    return bits.to(BITS[dtype][0]).view(dtype)


def logit_cases(batch: int, positions: int, vocab: int, dtype, seed: int) -> list[tuple[str, torch.Tensor]]:
    """(name, logits [batch, positions, vocab]) pairs; the last rows of some hold special values."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, positions, vocab)
    width = BITS[dtype][1]
    cases = []
    # few distinct values: ties everywhere, across blocks
    cases.append(("ties", torch.randint(-3, 4, shape, generator=g).to(dtype)))
    # bit patterns equal in their high bytes: the decision falls to the lower digits (positive and negative values)
    low = 8 if width == 16 else 16
    base = torch.tensor([0x3F00 if width == 16 else 0x3F800000])
    near = base + torch.randint(0, 1 << low, shape, generator=g)
    sign = torch.randint(0, 2, shape, generator=g).bool()
    cases.append(("low-digits", _from_bits(torch.where(sign, near - 2 ** (width - 1), near), dtype)))  # (sign bit set)
    # every bit pattern but NaN: subnormals, +-0, +-inf, both signs
    raw = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), shape, generator=g, dtype=torch.int64)
    x = _from_bits(raw, dtype)
    cases.append(("all-bits", torch.where(x.isnan(), torch.zeros((), dtype=dtype), x)))
    # special rows
    x = torch.randn(shape, generator=g).to(dtype).view(-1, vocab)
    inf = float("inf")
    if x.shape[0] > 1:
        x[1, ::3] = inf
        x[1, 1::3] = -inf
    if x.shape[0] > 2:
        x[2] = torch.where(torch.arange(vocab) % 2 == 0, torch.tensor(0.0), torch.tensor(-0.0)).to(dtype)
    if x.shape[0] > 3:
        x[3] = 1.5  # all equal
    if x.shape[0] > 4:
        x[4] = -inf
        x[4, vocab // 2] = 0.0
    if x.shape[0] > 5:
        x[5, vocab // 3] = float("nan")
    cases.append(("special", x.view(shape)))
    return cases


def strided_views(x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """x [B, J, V] as the backend may receive it: contiguous, the first J positions of a [B, J + 1, V] buffer (the
    draft's [B, K, V] of the target's), the last J of a wider one, and rows of V ids in a buffer wider than V."""
    batch, positions, vocab = x.shape
    wider = torch.empty(batch, positions + 2, vocab, dtype=x.dtype)
    wider[:, 1 : positions + 1] = x
    padded = torch.empty(batch, positions, vocab + 5, dtype=x.dtype)
    padded[..., :vocab] = x
    return [("contiguous", x), ("positions-slice", wider[:, 1 : positions + 1]), ("padded-rows", padded[..., :vocab])]


def _cuda_select():
    """The CUDA op (skipped where the extension cannot load: ``test_opcheck._cuda_ops``)."""
    from test_opcheck import _cuda_ops

    return _cuda_ops().kth_largest_index


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,positions,vocab", [(1, 5, 128256), (1, 4, 32000), (64, 5, 128256), (3, 2, 1001),
                                                   (2, 3, 1), (2, 3, 2048 * 7 + 3), (256, 300, 64)])
def test_select_on_cuda(dtype, batch, positions, vocab):
    select = _cuda_select()
    for name, x in logit_cases(batch, positions, vocab, dtype, seed=vocab + batch):  # (76800 rows: > 65535)
        for view_name, view in strided_views(x) if batch * vocab <= 2**20 else [("contiguous", x)]:
            v = view.cuda() if view.is_contiguous() else None
            if v is None:  # keep the view's strides on the device
                base = torch.empty_strided(view.shape, view.stride(), dtype=dtype, device="cuda")
                base.copy_(view)
                v = base
            for k in (ks(vocab) if vocab < 1000 else [1, 2, 50, vocab // 2, vocab - 1]):
                check_select(select, v, k)
            check_select(select, v[:, 0], min(50, vocab))  # [B, V] (the draft-side sample's logits)


@gpu
def test_select_refuses_bad_arguments():
    select = _cuda_select()
    x = torch.randn(2, 3, 10, device="cuda")
    for k in (0, 11):
        with pytest.raises(RuntimeError, match="k must be in"):
            select(x, k)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        select(x.double(), 3)
    with pytest.raises(RuntimeError, match=r"\[B, V\] or \[B, J, V\]"):
        select(x[0, 0], 3)


@gpu
def test_select_in_a_cuda_graph_and_compiled():
    """No host reads, its workspace from torch: a captured graph replays it on new logits; torch.compile (fullgraph)
    traces it through its fake implementation."""
    select = _cuda_select()
    x = torch.randn(2, 5, 128256, device="cuda", dtype=torch.bfloat16)
    select(x, 50)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select(x, 50)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = torch.topk(x.float(), 50, dim=-1).values[..., -1]
    assert torch.equal(x.float().gather(-1, out.long().unsqueeze(-1)).squeeze(-1), want)
    compiled = torch.compile(lambda t: select(t, 50), fullgraph=True)
    assert torch.equal(compiled(x), select(x, 50))


def test_bindings_schema_matches_the_fake():
    """topk_bindings.cpp's schema parses and cuda_backend.py's fake takes its arguments (CPU: no extension needed)."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = (root / "csrc" / "topk_bindings.cpp").read_text()
    assert "TORCH_LIBRARY_FRAGMENT(speculative_kernels_cuda" in text
    schema = re.search(r'm\.def\("([^"]+)"\)', text).group(1)
    parsed = torch._C.parse_schema(f"speculative_kernels_cuda::{schema}")
    tree = ast.parse((root / "speculative_kernels/ops/cuda_backend.py").read_text())
    fakes = {node.name: [a.arg for a in node.args.args] for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert [a.name for a in parsed.arguments] == fakes["_kth_largest_index_fake"] == ["logits", "k"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_select(dtype):
    """The Triton backend's radix select (``triton_select.kth_largest_index``, what ``triton_backend._cuts`` takes for
    top-k alone) under the same checks: on the CPU under TRITON_INTERPRET=1 (conftest) at V = 77 in chunks of 32 ids
    (3 programs per row, a partial last one), three calls per dtype (~1-2 s each: the interpreter runs every
    program's ops in Python); on a GPU the real kernels at V = 128256 as well."""
    from speculative_kernels.ops import triton_select

    device = "cuda" if ON_CUDA else "cpu"

    def select(x, k):
        return triton_select.kth_largest_index(x.to(device), k, block=16, chunk=32)

    cases = dict(logit_cases(2, 3, 77, dtype, seed=77))
    check_select(select, cases["special"], 38)
    check_select(select, strided_views(cases["low-digits"])[2][1], 76)  # rows padded to V + 5 (misaligned)
    check_select(select, cases["ties"], 1)
    if ON_CUDA:
        big = dict(logit_cases(1, 5, 128256, dtype, seed=5))
        for name, x in big.items():
            for k in (1, 50, 64128, 128255):
                check_select(lambda t, kk: triton_select.kth_largest_index(t.cuda(), kk, 2048, 4096), x, k)
