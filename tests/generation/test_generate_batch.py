"""Batch > 1: each row accepts its own count; greedy output equals HF's on the same left-padded batch; hole compaction
changes no token."""

import pytest
import torch

import speculative_kernels as sk
from speculative_kernels import BatchingOptions
from helpers.models import FAMILIES, drafts_for, llama
from helpers.prompts import left_padded


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("lengths", [[5, 9], [3, 8, 6, 1], [4, 4, 7, 2, 9, 5, 6, 3]])
def test_batched_greedy_matches_hf_per_row(family, lengths):
    target = FAMILIES[family]()
    draft = drafts_for(family, target)["perturbed" if len(lengths) % 2 else "unrelated"]
    ids, mask = left_padded(lengths)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                      max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


def test_rows_finish_at_different_times_and_on_first_token():
    target = llama()
    draft = llama(layers=1, seed=8)
    ids, mask = left_padded([6, 4, 7, 5], seed=2)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    eos = int(free[1, ids.shape[1]])  # row 1's very first new token becomes EOS
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                               pad_token_id=0)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=4,
                      max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0,
                      speculation_stats=stats)
    assert torch.equal(got, expected)
    assert got[1, ids.shape[1]] == eos and bool((got[1, ids.shape[1] + 1:] == 0).all())
    lengths = []
    for row in got[:, ids.shape[1]:].tolist():
        lengths.append(row.index(eos) + 1 if eos in row else len(row))
    assert stats.new_tokens == sum(lengths)


def test_self_draft_batch_accepts_everything():
    target = llama()
    ids, mask = left_padded([5, 3, 6])
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, draft_model=target, num_speculative_tokens=3,
                      max_new_tokens=12, do_sample=False, pad_token_id=0, speculation_stats=stats)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    assert stats.acceptance_rate == 1.0 and stats.accepted_histogram == [0, 0, 0, 3 * 3]


# ------------------------------------------------------------------------------------------ hole compaction
@pytest.mark.parametrize("family,cache,backend", [("llama", "static", "triton"), ("gpt2", "dynamic", "torch")])
def test_compaction_in_generation_gives_identical_tokens(family, cache, backend):
    """Compacting after almost every iteration (threshold 0.01) or only when unavoidable (threshold 1) changes
    nothing: greedy equals HF, sampling equals itself, and the eager run really compacted."""
    # Triton runs on a GPU when there is one (on the CPU only through the interpreter the suite turns on without one).
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    target = FAMILIES[family]().to(device)
    draft = drafts_for(family, target)["unrelated"].to(device)
    ids, mask = (t.to(device) for t in left_padded([3, 9, 5, 1, 7, 4], seed=9))
    kwargs = dict(attention_mask=mask, draft_model=draft, num_speculative_tokens=4, max_new_tokens=14, pad_token_id=0,
                  cache_implementation=cache)
    often, never = (BatchingOptions(compaction_threshold=t, compaction_backend=backend, drop_finished_fraction=None)
                    for t in (0.01, 1.0))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0)
    stats = sk.SpeculationStats()
    greedy = sk.generate(target, ids, do_sample=False, batching=often, speculation_stats=stats, **kwargs)
    assert torch.equal(greedy, expected)
    assert stats.compactions >= 4, stats.compactions
    sampled = []
    for options in (often, never):
        torch.manual_seed(3)
        sampled.append(sk.generate(target, ids, do_sample=True, top_k=30, batching=options, **kwargs))
    assert torch.equal(*sampled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention needs a GPU here (the CPU build's inductor "
                                                          "fails to compile it on the development machine)")
def test_flex_attention_batch_with_holes_matches_hf_on_cuda():
    """attn_implementation='flex_attention' takes the 2-D slot mask (capabilities: no 4-D masks), from which HF builds
    its block mask: a left-padded batch whose rows accept different counts (holes) still gives model.generate's
    tokens (float32)."""
    target = llama(hidden=64).cuda()
    draft = drafts_for("llama", target)["perturbed"].cuda()
    for model in (target, draft):
        model.set_attn_implementation("flex_attention")
    ids, mask = (t.cuda() for t in left_padded([5, 9, 3, 7], seed=3))
    common = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = target.generate(ids, **common)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, speculation_stats=stats, **common)
    assert torch.equal(got, expected)
    assert stats.acceptance_rate < 1


def test_runner_buffers_grown_mid_generation_keep_every_row_exact(monkeypatch):
    """The dynamic runner's slot mask and its additive mirror start at the slots a request needs at first and grow
    as the cache does (new columns real, 1 / 0.0): with the first allocation made as small as it can be, every
    iteration grows them, and a left-padded batch must still equal model.generate row for row (holes from rejected
    drafts and compaction off, at, and below the threshold)."""
    from speculative_kernels.generation import request

    monkeypatch.setattr(request, "initial_slots", lambda prompt_length, max_gamma, max_new_tokens: prompt_length + 2)
    target = llama()
    draft = drafts_for("llama", target)["perturbed"]
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=30, pad_token_id=0, eos_token_id=None, do_sample=False)
    expected = target.generate(ids, **kwargs)
    for threshold in (1.0, 0.25):
        batching = BatchingOptions(compaction_threshold=threshold, drop_finished_fraction=None)
        for drafting in (dict(draft_model=draft, num_speculative_tokens=4), dict(prompt_lookup_num_tokens=4)):
            got = sk.generate(target, ids, batching=batching, **drafting, **kwargs)
            assert torch.equal(got, expected), (threshold, list(drafting))


def test_a_dropped_rows_tail_is_the_pad_id_after_the_buffers_grow(monkeypatch):
    """A row that finished (EOS) and left the batch is written back into the full-size outputs; when the buffers
    grew after it left, its new columns must hold the pad id (HF pads finished rows), here a nonzero one."""
    from speculative_kernels.generation import buffers, context

    for module in (buffers, context):  # buffers start with room for 4 new tokens, then double
        monkeypatch.setattr(module, "INITIAL_NEW_TOKENS", 4)
    target = llama()
    ids = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    plain = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=1, eos_token_id=None)
    # an early token of row 1 that row 0 never emits, as EOS: row 1 finishes early, row 0 runs on
    at, early = next((j, t) for j, t in enumerate(plain[1, 6:12].tolist()) if t not in plain[0, 6:].tolist())
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=1, eos_token_id=early)
    expected = target.generate(ids, **kwargs)
    got = sk.generate(target, ids, draft_model=drafts_for("llama", target)["perturbed"], num_speculative_tokens=3,
                      batching=BatchingOptions(drop_finished_fraction=0.25), **kwargs)
    assert (expected[1, 6 + at + 1:] == 1).all() and torch.equal(got, expected)


def test_widen_fills_the_new_columns():
    """``buffers.widen`` pads with ``fill``, never leaves the new columns as allocated (fresh CPU memory often reads 0,
    which is the usual pad id: a missing fill would pass the generation tests)."""
    from speculative_kernels.generation.buffers import widen

    wide = widen(torch.ones(2, 2, dtype=torch.int64), 5, fill=7)
    assert wide.tolist() == [[1, 1, 7, 7, 7]] * 2
    assert widen(torch.zeros(1, 3, 2), 4, fill=-1.5)[0, 3].tolist() == [-1.5, -1.5]


def test_a_row_cut_by_its_stop_string_mid_iteration_has_zero_scores_after_it():
    """A batch row whose stop string ends before the iteration's last emitted token: its tokens after the stop are
    pad (as model.generate's), and so are its scores/logits zeros there, as for any finished row (README); they held
    the target's values at the cut draft positions (found by the fuzzer)."""
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast
    from transformers.generation import StopStringCriteria

    from helpers.checkpoints import tiny_tokenizer

    backend = tiny_tokenizer().backend_tokenizer
    backend.decoder = decoders.ByteLevel()  # (HF's stop-string matching decodes the vocabulary)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    target = llama()
    ids = torch.tensor([[0, 0, 5, 17, 42], [3, 9, 17, 42, 70]])
    mask = (ids != 0).long()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for cut in range(2, 7):
        stop = tokenizer.decode(plain[0, 5 : 5 + cut])[-2:]
        kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, stop_strings=[stop],
                      tokenizer=tokenizer, return_dict_in_generate=True, output_logits=True, output_scores=True)
        expected = target.generate(ids, **kwargs)
        criterion = StopStringCriteria(tokenizer, [stop])
        last = next(s for s in range(12) if criterion(expected.sequences[:1, : 6 + s], None)[0])  # row 0's last step
        got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=4, **kwargs)  # every draft kept
        assert torch.equal(got.sequences, expected.sequences), stop
        for steps in (got.scores, got.logits):
            assert all(not steps[s][0].any() for s in range(last + 1, len(steps))), (stop, last)
            assert all(steps[s][0].any() for s in range(last + 1))
