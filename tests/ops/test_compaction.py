"""``ops.compact_kv``: the reference semantics, Triton (interpreter on CPU) and CUDA bit-exact against it, schema and
build checks. (Hole compaction inside generation: ``tests/generation/test_generate_batch.py``.)"""

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from speculative_kernels.ops import backends
from speculative_kernels.ops.compaction import compact_kv, compact_kv_reference
from helpers.cuda_toolkit import torch_header_standards

ROOT = Path(__file__).resolve().parents[2]
ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
KERNEL_BACKENDS = ["triton"] + (["cuda"] if ON_CUDA else [])

# (B, H, S, D): partial tiles of every kernel (slot tiles 32/64/256, head-dim blocks up to 128), S = 1, D = 1.
SIZES = [(1, 1, 1, 1), (2, 3, 33, 5), (3, 2, 111, 64), (4, 1, 1000, 3), (1, 4, 257, 128), (5, 2, 64, 80)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(batch, heads, slots, head_dim, dtype, density=0.6, seed=0, pad=7):
    """kv: a strided view [B, H, S, D] of a longer slot buffer (like a cache's used prefix); slot_mask [B, S]."""
    g = torch.Generator().manual_seed(seed + slots)
    buffer = torch.randn(batch, heads, slots + pad, head_dim, generator=g).to(dtype).to(DEVICE)
    mask = (torch.rand(batch, slots, generator=g) < density).to(torch.int64).to(DEVICE)
    if batch > 1:
        mask[0] = 1  # a row without holes
        mask[-1, : slots // 2] = 0  # a left-padded row
    return buffer, buffer[:, :, :slots], mask


def _expected(kv, mask):
    """Written out per row from the definition (no shared code with the reference)."""
    want = kv.clone()
    for b in range(kv.shape[0]):
        real = [s for s in range(kv.shape[2]) if int(mask[b, s])]
        for j, s in enumerate(real):
            want[b, :, j] = kv[b, :, s]
    return want


def test_reference_semantics_on_a_hand_made_case():
    kv = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).reshape(2, 1, 6, 2)
    mask = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    original = kv.clone()
    lengths = compact_kv(kv, mask, backend="torch")
    assert lengths.tolist() == [3, 6]
    assert torch.equal(kv[0, 0, :3], original[0, 0, [1, 3, 4]])
    assert torch.equal(kv[0, 0, 3:], original[0, 0, 3:])  # past the real count: unchanged
    assert torch.equal(kv[1], original[1])


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_reference_matches_the_definition(size):
    buffer, kv, mask = _case(*size, torch.float32)
    want = _expected(kv, mask)
    tail = buffer[:, :, kv.shape[2]:].clone()
    compact_kv_reference(kv, mask)
    assert torch.equal(kv, want)
    assert torch.equal(buffer[:, :, kv.shape[2]:], tail)  # slots outside the view untouched


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_kernel_is_bit_exact_with_reference(backend, dtype, size):
    buffer, kv, mask = _case(*size, dtype, seed=3)
    want_buffer = buffer.clone()
    want_lengths = compact_kv(want_buffer[:, :, : kv.shape[2]], mask, backend="torch")
    lengths = compact_kv(kv, mask, backend=backend)
    assert torch.equal(lengths, want_lengths)
    assert torch.equal(buffer.view(torch.int8), want_buffer.view(torch.int8))  # bits, including the tail


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("size,dtype", [((2, 1, 70, 576), torch.bfloat16), ((1, 2, 45, 1000), torch.float32),
                                        ((1, 1, 40, 2100), torch.float16)], ids=str)
def test_rows_wider_than_one_staging_chunk(backend, size, dtype):
    """Slot rows over the CUDA kernel's 1024-byte staging chunk (a 576-wide bf16 latent cache: 1152 bytes; a partial
    last chunk; several chunks), bit-exact with the reference."""
    buffer, kv, mask = _case(*size, dtype, seed=13)
    want_buffer = buffer.clone()
    compact_kv(want_buffer[:, :, : kv.shape[2]], mask, backend="torch")
    compact_kv(kv, mask, backend=backend)
    assert torch.equal(buffer.view(torch.int8), want_buffer.view(torch.int8))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("density", [0.0, 1.0, 0.05, 0.95])
def test_kernel_edge_densities_and_several_tensors(backend, density):
    """Tensors of other head counts and sizes under one mask, as a static cache of multi-head latent attention holds
    them (keys [B, 1, S, kv_lora_rank], values [B, 1, S, qk_rope_head_dim]) beside a plain [B, H, S, D] pair."""
    tensors, masks = [], None
    for heads, head_dim in ((1, 16), (1, 8), (2, 16)):
        _, kv, mask = _case(3, heads, 70, head_dim, torch.float32, density=density, seed=11)
        tensors.append(kv)
        masks = mask
    if density == 0.0:
        masks.zero_()
    want = [t.clone() for t in tensors]
    compact_kv(want, masks, backend="torch")
    compact_kv(tensors, masks, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(tensors, want))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernel_on_second_device_with_first_current(backend):
    """A cache on cuda:1 while cuda:0 is current (a model split over GPUs): the kernel must run on cuda:1."""
    buffer, kv, mask = _case(3, 2, 300, 64, torch.bfloat16, seed=8)
    buffer, mask = buffer.to("cuda:1"), mask.to("cuda:1")
    kv = buffer[:, :, : kv.shape[2]]
    want = buffer.clone()
    compact_kv(want[:, :, : kv.shape[2]], mask, backend="torch")
    with torch.cuda.device(0):
        compact_kv(kv, mask, backend=backend)
    torch.cuda.synchronize("cuda:1")
    assert torch.equal(buffer.view(torch.int16), want.view(torch.int16))


def test_bad_inputs_raise():
    kv = torch.zeros(2, 1, 5, 4)
    with pytest.raises(ValueError, match=r"\[B, S\] must match"):
        compact_kv(kv, torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer or bool"):
        compact_kv(kv, torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"\[B, H, S, D\]"):
        compact_kv(torch.zeros(2, 5, 4), torch.ones(2, 5, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="backend 'cuda' cannot run"):
        if not ON_CUDA:
            compact_kv(kv, torch.ones(2, 5, dtype=torch.int64), backend="cuda")
        else:
            raise RuntimeError("backend 'cuda' cannot run (skipped on a CUDA machine)")


def _compiled_backend(name):
    """The backend module's op under torch.compile(fullgraph=True) (resolution happens once, outside the graph)."""
    impl = backends.implementation(name, DEVICE, family="compaction")
    compile_backend = "inductor" if ON_CUDA else "aot_eager"
    return torch.compile(impl.compact_kv, fullgraph=True, backend=compile_backend)


def test_torch_backend_under_torch_compile_fullgraph():
    _, kv, mask = _case(3, 2, 40, 8, torch.float32, seed=5)
    want = kv.clone()
    compact_kv(want, mask, backend="torch")
    _compiled_backend("torch")([kv], mask)
    assert torch.equal(kv, want)


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device: the CUDA and Triton ops under torch.compile")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_kernel_ops_under_torch_compile_fullgraph(backend):
    _, kv, mask = _case(3, 2, 300, 64, torch.bfloat16, seed=6)
    want = kv.clone()
    compact_kv(want, mask, backend="torch")
    _compiled_backend(backend)([kv], mask)
    assert torch.equal(kv, want)


# ---------------------------------------------------------------------------------------------------- build checks
def test_binding_schema_matches_fake():
    text = (ROOT / "csrc" / "rollback_bindings.cpp").read_text()
    assert "TORCH_LIBRARY_FRAGMENT(speculative_kernels_cuda" in text  # joins the namespace bindings.cpp defines
    schema = re.search(r'm\.def\("([^"]+)"\)', text).group(1)
    parsed = torch._C.parse_schema(f"speculative_kernels_cuda::{schema}")
    assert parsed.name == "speculative_kernels_cuda::compact_kv_"
    assert [a.name for a in parsed.arguments] == ["kv", "slot_mask"]
    assert parsed.arguments[0].alias_info is not None and parsed.arguments[0].alias_info.is_write


def test_jit_loader_and_setup_pick_up_the_rollback_sources():
    from speculative_kernels.ops import cuda_ext

    names = {Path(p).name for p in cuda_ext.source_files(ROOT / "csrc")}
    assert {"rollback_kernels.cu", "rollback_bindings.cpp"} <= names


# (rollback_bindings.cpp against torch's headers: test_cuda_build.py::test_bindings_syntax, one unit with bindings.cpp)


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, [0x7F81, 0x7FC1, -0x40, 0x3F80]),
                                        (torch.float16, [0x7D00, 0x7C01, -0x200, 0x3C00])], ids=str)
def test_the_reference_moves_bits_not_values(dtype, bits):
    """Values are copied bit for bit (the kernels move integers): torch's CPU gather converts fp16 / bf16 through
    float32, which quieted an fp16 signaling NaN and turned every bf16 NaN into 0xffff or 0x7fc0 by the CPU's
    instruction set, even in slots that do not move; the reference gathers the same-width integers."""
    kv = torch.tensor(bits, dtype=torch.int16).view(dtype).view(1, 1, 4, 1)
    before = kv.view(torch.int16).clone()
    compact_kv(kv, torch.ones(1, 4, dtype=torch.int64), backend="torch")
    assert torch.equal(kv.view(torch.int16), before)
    kv = torch.tensor(bits, dtype=torch.int16).view(dtype).view(1, 1, 4, 1)
    compact_kv(kv, torch.tensor([[0, 1, 1, 1]]), backend="torch")  # a hole first: every slot moves left by one
    assert torch.equal(kv.view(torch.int16)[0, 0, :3, 0], before[0, 0, 1:, 0])
