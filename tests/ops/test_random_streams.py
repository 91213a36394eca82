"""The Philox stream ids have one definition (``ops/philox.py``): the CUDA header is generated from it and current,
the kernels use the named constants only, and the streams never overlap."""

import re
from pathlib import Path

import torch

from speculative_kernels.ops import philox
from speculative_kernels.ops.randomness import DecodeRandomness, row_keys

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"


def test_cuda_header_is_generated_from_philox_py():
    assert (CSRC / "philox_streams.h").read_text() == philox.streams_header()


def test_no_other_source_defines_a_stream_id():
    """Only the generated header defines stream constants, and every kernel launch picks its stream by name."""
    for path in sorted(CSRC.glob("*.c*")):
        text = path.read_text()
        assert not re.search(r"constexpr\s+\w+\s+kStream(Accept|Position|Draft|RowKey)\b", text), path.name
        for value in re.findall(r"stream_base\s*=\s*([^;]+);", text):
            assert value.strip() in philox.STREAMS or value.strip() == "p.stream_base", (path.name, value)
    for path in sorted((ROOT / "speculative_kernels").rglob("*.py")):
        if path.name != "philox.py":
            text = path.read_text()
            for name in ("STREAM_ACCEPT", "STREAM_POSITION", "STREAM_DRAFT", "STREAM_ROW_KEY"):
                assert not re.search(rf"^{name}\s*=", text, flags=re.M), (path, name)
            for value in ("0x40000000", "0x60000000"):
                assert value not in text.lower(), (path, value)


def test_streams_are_disjoint():
    """STREAM_POSITION + j covers the block positions j = 0..K of any K up to 2**29 without reaching the sampler's
    stream, whose one id is below the row keys' two."""
    assert philox.STREAM_ACCEPT < philox.STREAM_POSITION
    assert philox.STREAM_POSITION + 2**29 < philox.STREAM_DRAFT < philox.STREAM_ROW_KEY
    assert philox.STREAM_ROW_KEY + 1 < 2**32
    assert len({value for value, _ in philox.STREAMS.values()}) == len(philox.STREAMS)


def test_row_keys_depend_on_the_seed_and_the_row_only():
    seed = torch.full((5,), 1234, dtype=torch.int64)
    keys = row_keys(seed)
    assert keys.dtype == torch.int64 and (keys >= 0).all() and len(set(keys.tolist())) == 5
    assert torch.equal(row_keys(seed[:3]), keys[:3])  # a row's key does not depend on the batch size
    assert not torch.equal(row_keys(seed + 1), keys)


def test_decode_randomness_counters_advance_in_place():
    torch.manual_seed(0)
    state = DecodeRandomness(3, torch.device("cpu"))
    first = state.draft()
    assert first.seed_per_row and first.offset.tolist() == [0, 0, 0]
    state.advance_draft()
    state.advance_draft()
    state.advance_verify()
    assert state.draft().offset.tolist() == [2, 2, 2] and state.verify().offset.tolist() == [1, 1, 1]
    assert first.offset.untyped_storage().data_ptr() == state.draft().offset.untyped_storage().data_ptr()
    keys = state.seed.clone()
    state.select_rows(torch.tensor([2, 0]))
    assert torch.equal(state.draft().seed, keys[[2, 0]])
    torch.manual_seed(0)
    drawn = torch.randint(0, 2**62, ())
    torch.manual_seed(0)
    single = DecodeRandomness(1, torch.device("cpu"))  # a batch of one is keyed like row 0 of a batch
    assert single.draft().seed_per_row and torch.equal(single.seed, row_keys(drawn.reshape(1)))


def test_row_keys_draw_their_two_halves_from_two_philox_words():
    """A key's low 32 bits and its high 31 bits are two Philox words (streams STREAM_ROW_KEY and +1), not one word
    twice (31 bits of key entropy)."""
    from speculative_kernels.ops.randomness import row_keys

    keys = row_keys(torch.arange(8, dtype=torch.int64) * 1000003)
    assert not bool(((keys & 0x7FFFFFFF) == ((keys >> 32) & 0x7FFFFFFF)).all())
