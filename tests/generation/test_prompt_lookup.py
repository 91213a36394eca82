"""Prompt lookup (``prompt_lookup_num_tokens``, no draft model): greedy token-identical to ``model.generate`` with
and without HF's prompt lookup (batch 1, left-padded batches where some rows match and others do not, dynamic and
static caches, compiled, T5/BART), whole sampled continuations against the target's distribution, one host read per
iteration, and the errors."""

import numpy as np
import pytest
import torch

import speculative_kernels as sk
from helpers.host_reads import step_reading_once
from helpers.models import FAMILIES, llama
from helpers.sampling import NEW, VOCAB, continuation_probs, hf_warpers, peaky
from helpers.seq2seq_models import SEQ2SEQ_FAMILIES
from helpers.stats import assert_matches
from speculative_kernels.generation.lookup_drafter import PromptLookupDrafter


def _repeating(batch=1, period=9, length=30, seed=0):
    """Prompts that repeat a random phrase: the lookup finds matches in them."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 97, (batch, period), generator=g)
    return phrase.repeat(1, length // period + 1)[:, :length]


def _random(batch=1, length=12, seed=1):
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def target():
    return llama()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("k,ngram", [(10, None), (3, 1), (5, 3)])
def test_batch_1_greedy_is_hf_with_and_without_prompt_lookup(family, k, ngram):
    model = FAMILIES[family]()
    for ids in (_repeating(), _random()):
        kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None)
        lookup = dict(prompt_lookup_num_tokens=k) | ({} if ngram is None else dict(max_matching_ngram_size=ngram))
        plain = model.generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **kwargs, **lookup), plain)
        stats = sk.SpeculationStats()
        got = sk.generate(model, ids, speculation_stats=stats, **kwargs, **lookup)
        assert torch.equal(got, plain)
        assert stats.draft_forwards == 0 and stats.new_tokens == 40


def test_lookup_saves_target_forwards_on_repeated_text(target):
    """A row that re-emits its prompt: the copies are accepted, far fewer target forwards than tokens; text without
    repeats costs one forward per token (no filler-only iterations: the loop drafts only what a row proposes)."""
    ids = _repeating(length=60)
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, max_new_tokens=40, do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=10,
                      speculation_stats=stats)
    assert torch.equal(got, expected)
    assert stats.accepted_tokens > 0 and stats.target_forwards < stats.new_tokens


@pytest.mark.parametrize("cache", [None, "static"])
def test_left_padded_batch_some_rows_match(target, cache):
    """Rows of different lengths, some repeating (matches) and some random (none), left-padded: each row is what
    model.generate gives the same batch."""
    rows = [_repeating(period=7, length=25, seed=2)[0], _random(length=9, seed=3)[0],
            _repeating(period=4, length=17, seed=4)[0], _random(length=14, seed=5)[0]]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, prompt_lookup_num_tokens=6, cache_implementation=cache, speculation_stats=stats,
                      **kwargs)
    assert torch.equal(got, expected)
    assert stats.accepted_tokens > 0


@pytest.mark.parametrize("do_sample", [False, True])
def test_fillers_past_a_rows_proposals_are_never_accepted(target, monkeypatch, do_sample):
    """Rows that propose fewer tokens than the iteration drafts pass their counts to ops.verify (num_draft_tokens):
    no row ever accepts more than it proposed, and the statistics count only proposed tokens."""
    from speculative_kernels.ops import torch_backend

    rows = [_repeating(period=5, length=20, seed=6)[0], _random(length=20, seed=7)[0]]
    ids = torch.stack(rows)
    calls = []
    verify = torch_backend.verify

    def recording_verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens=None):
        out, accepted = verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens)
        calls.append((draft_tokens.shape[1], num_draft_tokens, accepted))
        return out, accepted

    monkeypatch.setattr(torch_backend, "verify", recording_verify)
    stats = sk.SpeculationStats()
    sk.generate(target, ids, prompt_lookup_num_tokens=6, max_new_tokens=30, do_sample=do_sample, eos_token_id=None,
                speculation_stats=stats)
    assert calls and all(counts is not None for _, counts, _ in calls)
    assert any(bool((counts < width).any()) for width, counts, _ in calls)  # some row proposed fewer than drafted
    assert all(bool((accepted <= counts).all()) for _, counts, accepted in calls)
    assert stats.accepted_tokens <= stats.drafted_tokens


def test_rows_finish_at_different_times_and_leave_the_batch(target):
    ids = torch.cat([_repeating(2, seed=6), _random(2, length=30, seed=7)])
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = target.generate(ids, **kwargs, eos_token_id=[5, 17, 40])
    got = sk.generate(target, ids, prompt_lookup_num_tokens=4, eos_token_id=[5, 17, 40],
                      batching=sk.BatchingOptions(drop_finished_fraction=0.25), **kwargs)
    assert torch.equal(got, expected[:, : got.shape[1]])


def test_compiled_greedy_matches_hf(target):
    ids = torch.cat([_repeating(1, seed=8), _random(1, length=30, seed=9)])
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    got = sk.generate(target, ids, prompt_lookup_num_tokens=4, compile=sk.CompileOptions(backend="aot_eager"),
                      **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("cache", [None, "static"])
def test_seq2seq_greedy_matches_hf(family, cache):
    model = SEQ2SEQ_FAMILIES[family]()
    ids = torch.cat([_repeating(1, period=5, length=20, seed=10), _random(1, length=20, seed=11)])
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0  # a right-padded encoder row
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
    expected = model.generate(ids, **kwargs)
    got = sk.generate(model, ids, prompt_lookup_num_tokens=5, cache_implementation=cache, **kwargs)
    assert torch.equal(got, expected)


def test_encoder_input_is_searched():
    """Encoder-decoder: the decoder's last token is looked up in the encoder input (its real tokens) too."""
    encoder = torch.tensor([[7, 8, 9, 10, 11, 0, 0], [20, 21, 22, 23, 24, 25, 26]])
    encoder_real = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1] * 7]).bool()
    drafter = PromptLookupDrafter(3, 2, prefix=(encoder, encoder_real), max_new_tokens=8)
    decoder = torch.tensor([[0, 8], [0, 30]])
    drafter.start(decoder, torch.ones_like(decoder, dtype=torch.bool))
    tokens, q, count = drafter.propose(3, None)
    assert q is None and count.tolist() == [3, 0]
    assert tokens[0].tolist() == [9, 10, 11]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 3, 0.9)])
def test_whole_continuations_match_target_sampling(temperature, top_k, top_p):
    """One-hot q at the looked-up tokens (and fillers): the continuations follow the target's own distribution."""
    target = peaky(0, 2)
    prompt = torch.tensor([[1, 4, 3, 5, 1, 0, 2, 2, 2, 2, 2, 2]])  # the model's greedy path: lookups get accepted
    seqs, probs = continuation_probs(target, prompt, hf_warpers(temperature, top_k, top_p))
    torch.manual_seed(4321)
    stats = sk.SpeculationStats()
    rows = 6000
    ids = prompt.expand(rows, -1)  # the mask is given: pad id 0 occurs in the prompt (HF would mask it)
    out = sk.generate(target, ids, attention_mask=torch.ones_like(ids), prompt_lookup_num_tokens=2, do_sample=True,
                      temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=NEW, pad_token_id=0,
                      speculation_stats=stats)
    assert stats.accepted_tokens > rows // 10  # the lookup's drafts are verified and often accepted
    new = out[:, prompt.shape[1]:].numpy()
    codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


def test_one_host_read_per_iteration():
    target = llama()
    ids = torch.cat([_repeating(2, seed=12), _random(2, length=30, seed=13)])
    decoder = sk.SpeculativeDecoder(target, prompt_lookup_num_tokens=4)
    for kwargs in (dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_k=10, min_new_tokens=5)):
        session = decoder.start(ids, max_new_tokens=20, pad_token_id=0, **kwargs)
        assert step_reading_once(session) > 1


def test_decoder_session_matches_generate(target):
    ids = _repeating(1, seed=14)
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    session = sk.SpeculativeDecoder(target, prompt_lookup_num_tokens=5).start(ids, max_new_tokens=20,
                                                                               do_sample=False, eos_token_id=None)
    emitted = []
    while not session.finished:
        emitted += session.step()[0]
    assert emitted == expected[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kwargs,words", [
    (dict(draft_model="target", prompt_lookup_num_tokens=3), "pass either draft_model"),
    (dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens must be an int >= 1"),
    (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=0), "max_matching_ngram_size must be an int >= 1"),
    (dict(prompt_lookup_num_tokens=3, num_speculative_tokens=4), "disagree"),
    (dict(), "draft_model \\(or assistant_model\\) is required, or prompt_lookup_num_tokens"),
])
def test_errors(target, kwargs, words):
    if kwargs.get("draft_model") == "target":
        kwargs["draft_model"] = target
    with pytest.raises(ValueError, match=words):
        sk.generate(target, _random(), max_new_tokens=3, **kwargs)


def test_decoder_refuses_two_drafting_methods(target):
    with pytest.raises(ValueError, match="pass one of draft, prompt_lookup_num_tokens, assistant_early_exit or drafter"):
        sk.SpeculativeDecoder(target, target, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("latest,periodic", [(False, False), (True, False), (False, True)])
def test_other_rules_as_drafter_objects(target, latest, periodic):
    """HF's rule and the other variants, passed as drafter=: the same greedy tokens."""
    ids = torch.cat([_repeating(1, seed=15), _random(1, length=30, seed=16)])
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    drafter = PromptLookupDrafter(6, 2, max_new_tokens=24, prefer_latest=latest, periodic=periodic)
    assert torch.equal(sk.generate(target, ids, drafter=drafter, num_speculative_tokens=6, **kwargs), expected)


def test_prompt_lookup_from_a_generation_config(target):
    """HF's precedence: prompt_lookup_num_tokens set in a GenerationConfig (or the model's) turns prompt lookup on."""
    from transformers import GenerationConfig

    ids = _repeating(1, seed=17)
    config = GenerationConfig(prompt_lookup_num_tokens=4, max_matching_ngram_size=3, max_new_tokens=16,
                              do_sample=False)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, generation_config=config, eos_token_id=None, speculation_stats=stats)
    assert torch.equal(got, target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None))
    assert stats.num_speculative_tokens == 4 and stats.draft_forwards == 0


@pytest.mark.parametrize("k,gamma", [(2, None), (3, 6)])
def test_a_lookup_drafter_narrower_than_gamma_is_exact(target, k, gamma):
    """PromptLookupDrafter(k) (the docs' recipe for HF's rule) under a gamma > k (the default 5, or
    num_speculative_tokens): its proposal is padded to gamma with fillers. It returned k columns, and the loop's
    bookkeeping for gamma gave other tokens, silently. In a batch, after a row leaves (host counts unknown), too."""
    ids = torch.cat([_repeating(1, seed=21), _repeating(1, seed=22)])
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    extra = {} if gamma is None else dict(num_speculative_tokens=gamma)
    expected = target.generate(ids[:1], max_new_tokens=20, **kwargs)
    drafter = PromptLookupDrafter(k, 2, max_new_tokens=20, prefer_latest=False, periodic=False)
    assert torch.equal(sk.generate(target, ids[:1], drafter=drafter, max_new_tokens=20, **extra, **kwargs), expected)
    decoder = sk.SpeculativeDecoder(target, drafter=lambda: PromptLookupDrafter(k, 2, prefer_latest=False,
                                                                               periodic=False), **extra)
    long, short = (decoder.add_request(ids[0], max_new_tokens=20, eos_token_id=None),
                   decoder.add_request(ids[1], max_new_tokens=3, eos_token_id=None))
    while decoder.has_work():
        decoder.step()
    assert decoder.result(long).token_ids == expected[0, ids.shape[1]:].tolist()
    assert decoder.result(short).token_ids == target.generate(ids[1:], max_new_tokens=3, **kwargs)[0, -3:].tolist()


def test_a_checkpoints_prompt_lookup_yields_to_the_calls_drafting(target):
    """A model whose generation_config sets prompt_lookup_num_tokens: a draft_model or drafter passed to the call
    wins (it used to be refused as 'not both', though the user passed only one), and so does num_speculative_tokens
    (as over a checkpoint's num_assistant_tokens); the call's own prompt_lookup_num_tokens with a draft still
    raises, and max_matching_ngram_size with another drafter (where it would do nothing) is refused."""
    import copy

    model = copy.deepcopy(target)
    model.generation_config.prompt_lookup_num_tokens = 3
    ids = _repeating(1, seed=23)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    assert torch.equal(sk.generate(model, ids, draft_model=target, speculation_stats=stats, **kwargs), expected)
    assert stats.draft_forwards > 0
    drafter = PromptLookupDrafter(4, 2, max_new_tokens=12)
    assert torch.equal(sk.generate(model, ids, drafter=drafter, num_speculative_tokens=4, **kwargs), expected)
    stats = sk.SpeculationStats()
    assert torch.equal(sk.generate(model, ids, num_speculative_tokens=6, speculation_stats=stats, **kwargs), expected)
    assert stats.num_speculative_tokens == 6 and stats.draft_forwards == 0
    with pytest.raises(ValueError, match="pass either draft_model"):
        sk.generate(model, ids, draft_model=target, prompt_lookup_num_tokens=3, **kwargs)
    with pytest.raises(ValueError, match="max_matching_ngram_size applies to prompt lookup"):
        sk.generate(target, ids, draft_model=target, max_matching_ngram_size=3, **kwargs)


@pytest.mark.parametrize("compiled", [False, True])
def test_statistics_count_the_proposals_and_every_target_forward(target, monkeypatch, compiled):
    """Drafted tokens and alpha's tests count what the drafter proposed (its num_draft), not the fillers the
    iteration's width adds (the first iteration, and every compiled one, were counted as drafting the full K; a
    row accepting all of a shorter proposal as a failed test). Every target forward counts in tokens per target
    forward (those capped by short proposals or with no match were left out: about twice the measured value)."""
    from speculative_kernels.ops import torch_backend

    calls = []
    verify = torch_backend.verify

    def recording_verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens=None):
        out, accepted = verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens)
        counts = [draft_tokens.shape[1]] if num_draft_tokens is None else num_draft_tokens.tolist()
        calls.append((counts, accepted.tolist()))
        return out, accepted

    monkeypatch.setattr(torch_backend, "verify", recording_verify)
    forwards = []
    # The forward count is checked eagerly only: compiled, the captured steps' forwards are not the module's calls,
    # and a recording hook there is traced into the step and guarded on len(forwards), so every step recompiled
    # (~25 s of CPU).
    hook = None if compiled else target.register_forward_hook(
        sk.per_token_hook(lambda module, args, output: forwards.append(1)))
    # a prompt without repeats, then its own continuation: no match at first, then long ones
    ids = _random(length=12, seed=7)
    extra = dict(cache_implementation="static", compile=sk.CompileOptions(backend="aot_eager")) if compiled else {}
    stats = sk.SpeculationStats()
    try:
        got = sk.generate(target, ids, prompt_lookup_num_tokens=5, max_new_tokens=30, do_sample=False,
                          eos_token_id=None, pad_token_id=0, speculation_stats=stats, **extra)
    finally:
        if hook is not None:
            hook.remove()
    assert torch.equal(got, target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                                            pad_token_id=0))
    proposed = [(d, n) for counts, accepted in calls for d, n in zip(counts, accepted)]
    assert any(d < 5 for d, _ in proposed) and stats.new_tokens == 30
    assert stats.drafted_tokens == sum(d for d, _ in proposed)
    assert stats.accept_tests_passed == stats.accepted_tokens == sum(n for _, n in proposed)
    assert stats.accept_tests == sum(n + int(n < d) for d, n in proposed)
    if not compiled:
        assert len(forwards) == stats.target_forwards + stats.prefill_forwards
    assert stats.verify_steps == stats.target_forwards
    assert stats.mean_tokens_per_target_forward == 30 / stats.target_forwards


def test_no_match_drafts_nothing(target):
    """A prompt with no repeated n-gram: nothing is proposed, nothing counts as drafted (the first iteration was
    counted as drafting the full K, with a failed test)."""
    stats = sk.SpeculationStats()
    sk.generate(target, torch.tensor([[5, 6, 7, 8, 9, 10]]), prompt_lookup_num_tokens=3, max_new_tokens=4,
                do_sample=False, eos_token_id=None, speculation_stats=stats)
    assert stats.drafted_tokens == stats.accepted_tokens == stats.accept_tests == 0
    assert stats.mean_tokens_per_target_forward == 1.0 and stats.target_forwards == 4


def test_max_matching_ngram_size_defaults_to_hfs_2(monkeypatch):
    """The prompt ends with a 3-gram seen once (10 11 12 -> 40 41 42) and a 2-gram seen later (11 12 -> 50 51 52):
    unset, max_matching_ngram_size is HF's 2, so the proposals are those of an explicit 2."""
    from speculative_kernels.ops import torch_backend

    verify, calls = torch_backend.verify, []

    def recording(target_logits, draft_logits, draft_tokens, *args, **kwargs):
        calls.append(draft_tokens[0].tolist())
        return verify(target_logits, draft_logits, draft_tokens, *args, **kwargs)

    monkeypatch.setattr(torch_backend, "verify", recording)
    target, ids = llama(), torch.tensor([[10, 11, 12, 40, 41, 42, 20, 11, 12, 50, 51, 52, 10, 11, 12]])
    proposals = []
    for extra in ({}, dict(max_matching_ngram_size=2)):
        calls.clear()
        sk.generate(target, ids, prompt_lookup_num_tokens=3, max_new_tokens=8, do_sample=False, eos_token_id=None,
                    pad_token_id=0, **extra)
        proposals.append(list(calls))
    assert proposals[0] == proposals[1] and proposals[0][0] == [50, 51, 52]


def test_the_decoder_refuses_a_gamma_prompt_lookup_cannot_take_when_built():
    """SpeculativeDecoder(prompt_lookup_num_tokens=3, num_speculative_tokens="auto" or 5) was accepted, and so was
    every add_request; each request then ended with finish_reason="error" at its first step. Refused when built now,
    as generate and start() refuse it; an equal gamma runs."""
    target = llama()
    for gamma, match in (("auto", "'auto' is not available with prompt lookup"), (5, "disagree")):
        with pytest.raises(ValueError, match=match):
            sk.SpeculativeDecoder(target, prompt_lookup_num_tokens=3, num_speculative_tokens=gamma)
    decoder = sk.SpeculativeDecoder(target, prompt_lookup_num_tokens=3, num_speculative_tokens=3)
    request = decoder.add_request([5, 6, 7, 5, 6], max_new_tokens=6, do_sample=False)
    while decoder.has_work():
        decoder.step()
    result = decoder.result(request)
    assert result.finish_reason == "length"
    assert result.token_ids == target.generate(torch.tensor([[5, 6, 7, 5, 6]]), max_new_tokens=6,
                                               do_sample=False)[0, 5:].tolist()
