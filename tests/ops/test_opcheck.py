"""``torch.library.opcheck`` of every custom op on CUDA: schema (mutation annotations), fake implementation against the
real one, autograd registration, and AOT dispatch (what ``torch.compile`` relies on).

Needs a CUDA device: under ``TRITON_INTERPRET=1`` torch's ``wrap_triton`` hands the interpreter FakeTensors, so the
fake-tensor and AOT checks cannot run on the CPU (a torch limitation). ``benchmarks/gpu.py`` runs this file."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

B, K, V = 3, 4, 1001


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(0)
    target = torch.randn(B, K + 1, V, generator=g).to("cuda", dtype)
    draft = torch.randn(B, K, V, generator=g).to("cuda", dtype)
    tokens = torch.randint(0, V, (B, K), generator=g).cuda()
    seed = torch.tensor([3, 4, 5], device="cuda")
    offset = torch.zeros(B, dtype=torch.int64, device="cuda")
    return target, draft, tokens, seed, offset


def _triton_ops():
    pytest.importorskip("triton")
    from speculative_kernels.ops import compaction_triton, lookup_triton, triton_backend  # noqa: F401  (registers)

    return torch.ops.speculative_kernels


@pytest.mark.parametrize("case", ["sampling", "greedy_one_hot_q", "rows_and_limit", "rows_top_k_bound"])
def test_verify_triton(case):
    ns = _triton_ops()
    target, draft, tokens, seed, offset = _inputs()
    if case == "sampling":
        args = (target, draft, tokens, 0.7, 50, 0.9, None, None, None, False, 0, seed, offset, True, None)
    elif case == "greedy_one_hot_q":
        args = (target, None, tokens, 0.0, 0, 1.0, None, None, None, False, 0, seed, offset, True, None)
    elif case == "rows_and_limit":
        rows = (torch.tensor([0.0, 0.7, 1.3], device="cuda"), torch.tensor([0, 3, 0], device="cuda"),
                torch.tensor([1.0, 0.9, 0.5], dtype=torch.float64, device="cuda"))
        limit = torch.tensor([1, 4, 0], device="cuda")
        args = (target, draft, tokens, 1.0, 0, 1.0, *rows, True, 0, seed, offset, True, limit)
    else:  # a host bound of the rows' top_k (every sampled row with top_p < 1 has 0 < top_k <= 3)
        rows = (torch.tensor([0.0, 0.7, 1.3], device="cuda"), torch.tensor([0, 3, 2], device="cuda"),
                torch.tensor([0.5, 0.9, 0.5], dtype=torch.float64, device="cuda"))
        args = (target, draft, tokens, 1.0, 0, 1.0, *rows, True, 3, seed, offset, True, None)
    torch.library.opcheck(ns.verify_triton, args)


def test_sample_triton():
    ns = _triton_ops()
    target, _, _, seed, offset = _inputs()
    args = (target[:, 0], 0.7, 2, 0.9, None, None, None, False, 0, seed, offset, True)
    torch.library.opcheck(ns.sample_triton, args)


def test_compact_kv_triton():
    ns = _triton_ops()
    kv = torch.randn(2, 2, 5, 4, device="cuda")
    mask = torch.tensor([[1, 0, 1, 0, 1], [0, 0, 1, 1, 0]], dtype=torch.int8, device="cuda")
    torch.library.opcheck(ns.compact_kv_triton, (kv, mask))


def test_prompt_lookup_triton():
    ns = _triton_ops()
    tokens = torch.tensor([[5, 6, 7, 5, 6, 0, 0], [1, 2, 3, 1, 2, 3, 1]], device="cuda")
    start = torch.zeros(2, dtype=torch.int64, device="cuda")
    end = torch.tensor([5, 7], device="cuda")
    torch.library.opcheck(ns.prompt_lookup_triton, (tokens, start, end, 3, 2, True, False))


def _cuda_ops():
    from speculative_kernels.ops import cuda_ext

    reason = cuda_ext.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from speculative_kernels.ops import compaction_cuda, cuda_backend  # noqa: F401  (fake implementations)

    return torch.ops.speculative_kernels_cuda


@pytest.mark.parametrize("with_draft", [True, False])
def test_verify_cuda(with_draft):
    ns = _cuda_ops()
    target, draft, tokens, seed, offset = _inputs()
    limit = torch.tensor([1, 4, 0], device="cuda")
    args = (target, draft if with_draft else None, tokens, 0.7, None, None, None, None, None, seed, offset, True,
            limit)
    torch.library.opcheck(ns.verify, args)


def test_sample_cuda():
    ns = _cuda_ops()
    target, _, _, seed, offset = _inputs()
    torch.library.opcheck(ns.sample, (target[:, 0], 0.7, None, None, None, seed, offset, True))


def test_kth_largest_index_cuda():
    ns = _cuda_ops()
    target, _, _, _, _ = _inputs()
    torch.library.opcheck(ns.kth_largest_index, (target, 3))
    torch.library.opcheck(ns.kth_largest_index, (target[:, 0], 1))


def test_compact_kv_cuda():
    ns = _cuda_ops()
    kv = torch.randn(2, 2, 5, 4, device="cuda")
    mask = torch.tensor([[1, 0, 1, 0, 1], [0, 0, 1, 1, 0]], dtype=torch.int8, device="cuda")
    torch.library.opcheck(ns.compact_kv_, (kv, mask))
