"""Encoder-decoder models (T5, BART) on the static cache and with compile=True (``seq2seq_static.py``).

Greedy tokens equal HF's own ``generate`` (its default dynamic cache), sampling equals our dynamic path with the same
seed, rollback moves pointers only (no K/V copies, the cross-attention cache kept), ``max_length`` counts the decoder
sequence as HF does. Compiled steps run on the CPU with the ``aot_eager`` backend.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import speculative_kernels as sk
from helpers.host_reads import step_reading_once
from speculative_kernels import CompileOptions
from speculative_kernels.generation.request import build_loop
from speculative_kernels.generation.runners.static_seq2seq import StaticSeq2SeqRunner
from helpers.seq2seq_models import bart, mbart, seq2seq_drafts_for, source_batch, t5

FAMILIES = {"t5": t5, "bart": bart}
REJECTING = {"t5": "perturbed", "bart": "unrelated"}  # drafts the target rejects sometimes (acceptance 0.03-0.4)
TRACE_ONLY = CompileOptions(backend="aot_eager")


@pytest.fixture(scope="module")
def pairs():
    """family -> (target, a draft it sometimes rejects)."""
    out = {}
    for family, make in FAMILIES.items():
        target = make()
        out[family] = (target, seq2seq_drafts_for(family, target)[REJECTING[family]])
    return out


def _source(target, lengths, seed=0):
    return source_batch(lengths, seed=seed, pad=target.config.pad_token_id)


def _greedy_pair(target, draft, ids, mask, gamma, stats=None, **kwargs):
    """(HF's greedy output with its default cache, ours on the static cache)."""
    expected = target.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=gamma,
                      do_sample=False, cache_implementation="static", speculation_stats=stats, **kwargs)
    return expected, got


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("lengths", [[7], [5, 9]])
@pytest.mark.parametrize("gamma", [1, 4])
def test_static_greedy_matches_hf(pairs, family, lengths, gamma):
    target, draft = pairs[family]
    ids, mask = _source(target, lengths, seed=len(lengths))
    stats = sk.SpeculationStats()
    expected, got = _greedy_pair(target, draft, ids, mask, gamma, stats, max_new_tokens=16)
    assert torch.equal(got, expected), (got, expected)
    assert 0 < stats.acceptance_rate < 1  # drafts were rejected: the caches were rolled back


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_eos_inside_a_block_and_finished_rows_leave(pairs, family):
    """A self-draft accepts whole blocks of 5 new tokens, so row 1's EOS (a token it first emits as its 2nd to 4th)
    lands inside one; the finished row leaves the batch (both caches and the pointers are selected)."""
    target, _ = pairs[family]
    ids, mask = _source(target, [6, 4, 7], seed=2)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                           forced_eos_token_id=None)
    at = next(j for j in range(2, 5) if int(free[1, j]) not in free[1, 1:j].tolist())
    eos = int(free[1, at])
    stats = sk.SpeculationStats()
    expected, got = _greedy_pair(target, target, ids, mask, 4, stats, max_new_tokens=10, eos_token_id=eos,
                                 forced_eos_token_id=None)
    assert torch.equal(got, expected), (got, expected)
    assert got[1, at] == eos and stats.dropped_rows > 0


def test_static_padded_decoder_prompt_as_in_hf(pairs):
    """Decoder prompt pads are masked but keep their positions (BART's learned positions)."""
    target, draft = pairs["bart"]
    ids, mask = _source(target, [5, 8])
    decoder_ids = torch.tensor([[2, 1, 30, 31], [2, 50, 51, 52]])
    decoder_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    expected, got = _greedy_pair(target, draft, ids, mask, 3, max_new_tokens=9, decoder_input_ids=decoder_ids,
                                 decoder_attention_mask=decoder_mask)
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_sampling_equals_dynamic(pairs, family):
    """Same seed, same tokens: the randomness is explicit (Philox per row), so only the logits could differ."""
    target, draft = pairs[family]
    ids, mask = _source(target, [5, 9, 3], seed=3)
    runs, stats = [], []
    for cache in ("dynamic", "static"):
        torch.manual_seed(5)
        stats.append(sk.SpeculationStats())
        runs.append(sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                                do_sample=True, temperature=0.8, top_k=20, max_new_tokens=16,
                                cache_implementation=cache, speculation_stats=stats[-1]))
    assert torch.equal(*runs), runs
    assert 0 < stats[1].acceptance_rate < 1


def test_static_rollback_moves_pointers_only(pairs):
    """Every step: the same K/V buffers (capacity-sized, never copied), the same cross-attention tensors (computed
    by the first forward), and each target row's pointer at its decoder length minus the pending token."""
    target, draft = pairs["t5"]
    ids, mask = _source(target, [5, 9])
    with torch.inference_mode():
        loop = build_loop(target, draft, ids, attention_mask=mask, num_speculative_tokens=4, do_sample=False,
                          max_new_tokens=12, eos_token_id=None, cache_implementation="static")
        runners = (loop.target_runner, loop.drafter.runner)
        assert all(isinstance(r, StaticSeq2SeqRunner) for r in runners)
        buffers = [[t.data_ptr() for t in r.cache.self_attention_cache.tensors()] for r in runners]
        assert all(t.shape[2] == r.capacity for r in runners for t in r.cache.self_attention_cache.tensors())
        cross = None
        while loop.step():
            assert [[t.data_ptr() for t in r.cache.self_attention_cache.tensors()] for r in runners] == buffers
            now = [[layer.keys.data_ptr() for layer in r.cache.cross_attention_cache.layers] for r in runners]
            assert cross is None or now == cross
            cross = now
            live = ~loop.finished  # a finished row keeps nothing of its last iteration
            assert torch.equal(loop.target_runner.next_position[live], loop.generated[live])  # 1 + generated - 1
    assert loop.stats.accepted_tokens < loop.stats.drafted_tokens


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_one_host_read_per_iteration(pairs, family):
    """The capacity check's bound on the rows' lengths comes with the loop's one read per iteration."""
    target, draft = pairs[family]
    ids, mask = _source(target, [6, 4, 5])
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=True, top_k=20, cache_implementation="static")
    assert isinstance(session.loop.target_runner, StaticSeq2SeqRunner)
    steps = step_reading_once(session)
    assert steps > 5


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_max_length_counts_the_decoder_sequence(pairs, family, cache):
    """HF counts max_length over the decoder sequence, decoder start token (and decoder_input_ids) included."""
    target, draft = pairs[family]
    ids, mask = _source(target, [5, 9], seed=3)
    start = target.config.decoder_start_token_id
    for kwargs in (dict(max_length=2), dict(max_length=9), dict(max_length=6, decoder_input_ids=torch.tensor(
            [[start, 17, 23], [start, 40, 41]]))):
        expected = target.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
        got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                          do_sample=False, cache_implementation=cache, **kwargs)
        assert got.shape[1] == kwargs["max_length"]
        assert torch.equal(got, expected), (kwargs, got, expected)


def test_static_refuses_attention_without_4d_masks(pairs):
    target, draft = pairs["t5"]
    ids, mask = _source(target, [4])
    original = draft.config._attn_implementation
    draft.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="T5ForConditionalGeneration.*attn_implementation='flash_attention_2'"):
            sk.generate(target, ids, attention_mask=mask, draft_model=draft, cache_implementation="static")
    finally:
        draft.config._attn_implementation = original
    with pytest.raises(ValueError, match="fixed num_speculative_tokens"):
        sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens="auto",
                    cache_implementation="static")


# ------------------------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("family", ["t5", "bart"])
def test_compiled_calls_of_other_source_lengths_reuse_the_compiled_steps(pairs, family):
    """The captured steps read the cross-attention K/V, whose source length they are specialised to: the source is
    padded to a bucket (never attended), so sources of other lengths reuse them (every new length compiled three
    graphs, and after ~21 lengths dynamo's limit ended the process's compiled calls); outputs stay HF's, also with a
    row whose source is all padding (T5's only: not padded, since T5's attention adds the mask, so such a row weighs
    every key; its batch compiles steps of its own, ~1/3 of the test's CPU), and in batches of two (fixed shapes: no
    row is dropped) whose sources of other lengths reuse the batch's steps too. (One test for what were three: each
    compiled its own steps, ~10-20 s of CPU apiece.)"""
    target, draft = pairs[family]
    common = dict(do_sample=False, max_new_tokens=8)
    for call, lengths in enumerate(([5], [6], [9], [4, 7], [5, 9], [8, 6])):
        if call == 3 and family != "t5":
            continue
        ids, mask = _source(target, lengths, seed=call)
        if call == 3:
            mask[0] = 0
        graphs = counters["stats"]["unique_graphs"]
        stats = sk.SpeculationStats()
        got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                          compile=TRACE_ONLY, speculation_stats=stats, **common)
        assert torch.equal(got, target.generate(ids, attention_mask=mask, **common))
        assert stats.warmup_time_s > 0 and stats.dropped_rows == 0
        if call in (1, 2, 5):  # (the first call, the batch with an empty row and the first plain batch compile)
            assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("family", ["mbart", "mt5"])
def test_static_mbart_and_mt5_batches_match_hf(family):
    """The other two supported types: mBART (scaled embeddings, a forced language code) and MT5 (T5's layout in its
    own classes)."""
    make = {"mbart": mbart, "mt5": lambda **kw: t5(mt5=True, **kw)}[family]
    target, draft = make(), make(layers=1, hidden=16, seed=5)
    ids, mask = _source(target, [5, 9, 3], seed=4)
    stats = sk.SpeculationStats()
    expected, got = _greedy_pair(target, draft, ids, mask, 3, stats, max_new_tokens=12)
    assert torch.equal(got, expected), (got, expected)
    assert stats.accepted_tokens < stats.drafted_tokens


def test_dict_output_is_the_exported_class(pairs):
    target, draft = pairs["bart"]
    ids, mask = _source(target, [6])
    out = sk.generate(target, ids, attention_mask=mask, draft_model=draft, max_new_tokens=5, do_sample=False,
                      cache_implementation="static", return_dict_in_generate=True)
    assert isinstance(out, sk.SpeculativeEncoderDecoderOutput) and out.speculation_stats.new_tokens > 0
    assert "SpeculativeEncoderDecoderOutput" in sk.__all__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (ids and model on different devices)")
@pytest.mark.parametrize("decoder_ids", [False, True])
def test_result_is_on_the_device_of_the_callers_ids(decoder_ids):
    """Ids on the CPU and the model on CUDA: HF's encoder-decoder generate fails (it runs the encoder on the ids as
    given; its decoder start is made on the model's device and compared with the caller's decoder_input_ids), so the
    reference is HF with everything on CUDA. Ours returns the decoder sequences where the caller's ids are, as for
    decoder-only models (HF's there): decoder_input_ids' device when given, else input_ids'."""
    target = t5().cuda()
    ids, mask = source_batch([6, 4])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    if decoder_ids:
        start = target.config.decoder_start_token_id
        kwargs["decoder_input_ids"] = torch.tensor([[start, 5], [start, 7]])
    on_cuda = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    expected = target.generate(ids.cuda(), **on_cuda)
    got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=2, **kwargs)
    assert got.device == torch.device("cpu")
    assert torch.equal(got, expected.cpu())


def test_the_memory_check_counts_the_cross_attention_cache_and_the_encoder_output(monkeypatch):
    """The static check counted the decoder's self-attention K/V only: a 250-token source's cross-attention K/V and
    encoder output were ~13-17x the checked bound on the tiny models (found by the memory hunt)."""
    from speculative_kernels.generation.capabilities import check_model
    from speculative_kernels.generation.runners import factory
    from speculative_kernels.generation.runners.slot_cache import CacheLayout

    seen = []
    monkeypatch.setattr(factory, "check_free_memory", lambda required, *args, **kwargs: seen.append(required))
    target = t5()
    source = torch.randint(3, 97, (1, 250), generator=torch.Generator().manual_seed(0))
    sk.generate(target, source, draft_model=target, max_new_tokens=4, cache_implementation="static")
    spec = seen[0]
    layout = CacheLayout.of(target, check_model(target, path="static", batch=1))
    assert spec["cross_attention_kv"] == 2 * layout.bytes(1, 250)  # (target and draft: the same model twice)
    assert spec["encoder_outputs"] == 2 * 250 * target.config.d_model * 4
    assert spec["total"] >= spec["kv_caches"] + spec["cross_attention_kv"] + spec["encoder_outputs"]
