"""A cache of the prompt's first tokens (``past_key_values=`` / ``cache=``: HF's prompt-cache recipe,
``generation/prompt_cache.py``): the target forwards only the uncached tokens, as ``model.generate`` does.

The caches here are built over *other* tokens than the prompt's first ones (HF uses the cache as given, whatever the
ids it stands for), so a run that ignored the cache and prefilled the whole prompt would give other tokens: each
comparison with ``model.generate(..., past_key_values=deepcopy(cache))`` checks that the cache was used, and used
as HF uses it.
"""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache, StaticCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

import speculative_kernels as sk
from helpers.models import FAMILIES, hf_generate, llama, more_families, perturbed
from helpers.prompts import left_padded
from helpers.sampling import NEW, VOCAB, hf_warpers, peaky
from helpers.seq2seq_models import t5
from helpers.stats import assert_matches
from speculative_kernels.generation.prompt_cache import extend_caller_cache
from speculative_kernels.generation.runners.dynamic_cache import RollbackCache

WIDTH, NEW_TOKENS = 12, 16
# the output's cache field: cache from transformers 5.24, past_key_values before
CACHE_FIELD = next(f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)
                   if f.name in ("cache", "past_key_values"))


def prompt_cache(model, ids, mask=None, config=False) -> DynamicCache:
    """HF's recipe: a DynamicCache filled by one forward of ``model`` over ids [B, P] (mask [B, P])."""
    cache = DynamicCache(config=model.config) if config else DynamicCache()
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    return cache


def kv_snapshot(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]


def assert_untouched(cache, snapshot) -> None:
    """The caller's cache holds what it held before the call (a call that raised, or a batch > 1)."""
    now = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert len(now) == len(snapshot) and all(torch.equal(a, b) for a, b in zip(now, snapshot))


def assert_extended_as_hf(ours, hf, real=None) -> None:
    """The caller's cache after our call holds what model.generate left in its copy: as many tokens, their keys and
    values equal up to float rounding (ours from multi-token verification forwards, HF's from one-token steps).
    real: [S] bool, the slots compared (None: all; a left pad's K/V are masked in every later call, and differ)."""
    assert ours.get_seq_length() == hf.get_seq_length()
    assert len(ours.layers) == len(hf.layers)
    for mine, theirs in zip(ours.layers, hf.layers):
        assert type(mine) is type(theirs) and mine.keys.shape == theirs.keys.shape
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            keep = slice(None) if real is None else real
            torch.testing.assert_close(a[:, :, keep], b[:, :, keep], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def pair():
    target = llama()
    return target, perturbed(target)


@pytest.mark.parametrize("cached", [1, 6, WIDTH - 1])
@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_greedy_batch_one_is_model_generate_with_the_cache(pair, cached, name):
    target, draft = pair
    ids = left_padded([WIDTH], seed=1)[0]
    other = left_padded([WIDTH], seed=2)[0][:, :cached]  # the cache stands for other tokens: it must be used
    cache = prompt_cache(target, other)
    hf_cache = copy.deepcopy(cache)
    expected = hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=hf_cache)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=NEW_TOKENS,
                      do_sample=False, **{name: cache})
    assert torch.equal(got, expected)
    assert_extended_as_hf(cache, hf_cache)  # (HF extends it in place: prompt and new tokens but the last)
    if cached > 1:  # (the cache changes the tokens: a run that ignored it would fail above)
        assert not torch.equal(expected, hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False))


@pytest.mark.parametrize("cached", [2, 5, 9])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_left_padded_batch_is_model_generate_with_the_cache(family, cached, chunk):
    """The mask's first P columns mark the cached pads (holes), and the uncached tokens take the positions the
    whole mask gives them, as in HF; with prefill_chunk_size the uncached tokens are prefilled in chunks. These tiny
    models' greedy tokens hardly depend on positions, so the logits are compared too (to 1e-5, against ~1e-7 of
    rounding: a position shifted by the cached pads moves them by 1e-3 on Llama, 0.3 on GPT-2). The reference is
    model.generate with the cache and without chunks, which transformers 5.24's chunked prefill gives too; 5.17's
    chunked prefill over a prompt cache gives other tokens than its own unchunked one (its defect, since fixed)."""
    target = FAMILIES[family]()
    draft = perturbed(target)
    ids, mask = left_padded([WIDTH, 9, 4], seed=3)
    other = left_padded([WIDTH, 9, 4], seed=4)[0][:, :cached]
    cache = prompt_cache(target, other, mask[:, :cached])
    settings = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                    output_logits=True)
    expected = hf_generate(target, ids, past_key_values=copy.deepcopy(cache), **settings)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, past_key_values=cache,
                      prefill_chunk_size=chunk, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", [False, True])
def test_sliding_window_layers_that_dropped_nothing(config):
    """A Mistral-like target (window 4): its DynamicCache(config=...) has sliding-window layers, which hold every
    token while the prefix is shorter than the window."""
    target = more_families()["mistral"]()  # (a window of 4 tokens)
    ids, mask = left_padded([WIDTH, 8], seed=5)
    cache = prompt_cache(target, left_padded([WIDTH, 8], seed=6)[0][:, :3], mask[:, :3], config=config)
    expected = hf_generate(target, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                           past_key_values=copy.deepcopy(cache))
    got = sk.generate(target, ids, attention_mask=mask, draft_model=perturbed(target), max_new_tokens=NEW_TOKENS,
                      do_sample=False, past_key_values=cache)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("cached, new, eos", [(0, NEW_TOKENS, None), (4, 1, None), (4, 2, None), (9, 40, 7),
                                               (3, 40, 50)])
def test_the_callers_cache_is_extended_as_model_generate_extends_it(pair, cached, new, eos):
    """After the call the caller's cache holds the K/V of the prompt and of every new token but the last, as HF's
    does: never those of the drafts verified past the last token (gamma 4 here), nor past an EOS in the middle of
    an iteration's accepted drafts."""
    target, draft = pair
    ids = left_padded([WIDTH], seed=16)[0]
    cache = prompt_cache(target, left_padded([WIDTH], seed=17)[0][:, :cached]) if cached else DynamicCache()
    hf_cache = copy.deepcopy(cache)
    settings = dict(max_new_tokens=new, do_sample=False, eos_token_id=eos)
    expected = hf_generate(target, ids, past_key_values=hf_cache, **settings)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, past_key_values=cache, **settings)
    assert torch.equal(got, expected)
    assert hf_cache.get_seq_length() == expected.shape[1] - 1
    assert_extended_as_hf(cache, hf_cache)


def test_a_left_padded_prompt_of_one_row_keeps_its_pads_slots(pair):
    """A batch-1 prompt with left padding: HF's cache holds a slot for each pad (masked in every later call), ours
    too; the real slots' K/V are HF's."""
    target, draft = pair
    ids, mask = left_padded([WIDTH], seed=18)
    mask[:, :3] = 0
    cache = prompt_cache(target, left_padded([WIDTH], seed=19)[0][:, :2], mask[:, :2])
    hf_cache = copy.deepcopy(cache)
    settings = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = hf_generate(target, ids, past_key_values=hf_cache, **settings)
    got = sk.generate(target, ids, draft_model=draft, past_key_values=cache, **settings)
    assert torch.equal(got, expected)
    real = torch.ones(expected.shape[1] - 1, dtype=torch.bool)
    real[:3] = False
    assert_extended_as_hf(cache, hf_cache, real)


def test_sliding_window_layers_of_the_callers_cache_drop_as_hfs_do():
    """A Mistral-like target (window 4) with DynamicCache(config=...): the caller's sliding-window layers keep their
    last window - 1 tokens after the call, as HF's (their own update drops the rest)."""
    target = more_families()["mistral"]()
    ids = left_padded([WIDTH], seed=20)[0]
    cache = prompt_cache(target, left_padded([WIDTH], seed=21)[0][:, :3], config=True)
    hf_cache = copy.deepcopy(cache)
    expected = hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=hf_cache)
    got = sk.generate(target, ids, draft_model=perturbed(target), max_new_tokens=NEW_TOKENS, do_sample=False,
                      past_key_values=cache)
    assert torch.equal(got, expected)
    assert cache.layers[0].keys.shape[-2] < cache.get_seq_length()  # (it dropped tokens)
    assert_extended_as_hf(cache, hf_cache)


def _turn_prompts(turns: int):
    """HF's multi-turn recipe on token ids: each turn's prompt is the last turn's prompt, its reply (edited on odd
    turns: its first two tokens replaced, as a user editing it or a chat template rendering it otherwise), then a
    new message. Returns a function of the previous output ([1, L + n] or None) and the turn -> the prompt [1, L']."""
    messages = [left_padded([5], seed=30 + turn)[0] for turn in range(turns)]

    def prompt(previous, turn):
        if previous is None:
            return messages[0]
        reply = previous.clone()
        if turn % 2:
            reply[:, -NEW_TOKENS: -NEW_TOKENS + 2] = torch.tensor([[5, 6]])
        return torch.cat([reply, messages[turn]], dim=1)
    return prompt


def _chat(generate, turns: int = 4) -> list[torch.Tensor]:
    """Each turn's new tokens, with one DynamicCache passed to every turn (HF's KV-cache guide)."""
    prompt, cache, previous, replies = _turn_prompts(turns), DynamicCache(), None, []
    for turn in range(turns):
        ids = prompt(previous, turn)
        previous = generate(ids, cache)
        replies.append(previous[:, ids.shape[1]:])
    return replies


def test_hfs_multi_turn_recipe_gives_model_generates_tokens_every_turn(pair):
    """One cache object for every turn: where a turn's prompt does not start with what the cache holds (an edited
    reply), model.generate continues from it as it is, and so must we (with the cache left as it was, each turn
    would prefill in full and give the tokens of a call without a cache)."""
    target, draft = pair
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = _chat(lambda ids, cache: hf_generate(target, ids, past_key_values=cache, **settings))
    got = _chat(lambda ids, cache: sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3,
                                               past_key_values=cache, **settings))
    fresh = _chat(lambda ids, cache: hf_generate(target, ids, **settings))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not all(torch.equal(a, b) for a, b in zip(fresh, expected))  # (the stale cache changes the tokens)


def test_a_batch_leaves_the_cache_as_it_was_with_a_warning(pair):
    """At batch > 1 HF's cache also holds the K/V of the pads it feeds finished rows: not reproduced, so the cache
    is left as it was, the output's cache field is None, and a UserWarning says so (not silently)."""
    target, draft = pair
    ids, mask = left_padded([WIDTH, 7], seed=22)
    cache = prompt_cache(target, left_padded([WIDTH, 7], seed=23)[0][:, :5], mask[:, :5])
    snapshot = kv_snapshot(cache)
    with pytest.warns(UserWarning, match="past_key_values was not extended") as caught:
        out = sk.generate(target, ids, attention_mask=mask, draft_model=draft, max_new_tokens=NEW_TOKENS,
                          do_sample=False, past_key_values=cache, return_dict_in_generate=True)
    assert any(w.filename == __file__ for w in caught)  # (pointing at the call)
    assert getattr(out, CACHE_FIELD) is None
    assert_untouched(cache, snapshot)


class _RaisingCriterion:
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_call_that_raises_leaves_the_cache_as_it_was(pair):
    """A call that raises (here a stopping criterion, after the first iteration) writes nothing to the caller's cache
    (HF's holds the steps it ran), so the same call can be run again on it, and extends it as model.generate."""
    target, draft = pair
    ids = left_padded([WIDTH], seed=24)[0]
    cache = prompt_cache(target, ids[:, :6])
    snapshot, hf_cache = kv_snapshot(cache), copy.deepcopy(cache)
    with pytest.raises(RuntimeError, match="criterion failed"):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=NEW_TOKENS, do_sample=False,
                    past_key_values=cache, stopping_criteria=[_RaisingCriterion()])
    assert_untouched(cache, snapshot)
    expected = hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=hf_cache)
    got = sk.generate(target, ids, draft_model=draft, max_new_tokens=NEW_TOKENS, do_sample=False,
                      past_key_values=cache)
    assert torch.equal(got, expected)
    assert_extended_as_hf(cache, hf_cache)


def _drafting(kind, target):
    return {"prompt lookup": dict(prompt_lookup_num_tokens=3),
            "ngram": dict(drafter=sk.NGramDrafter(97, order=2)),
            "early exit": dict(assistant_early_exit=1),
            "max_new_tokens=1": dict(draft_model=perturbed(target), max_new_tokens=1)}[kind]


@pytest.mark.parametrize("kind", ["prompt lookup", "ngram", "early exit", "max_new_tokens=1"])
def test_other_drafters_and_one_new_token(pair, kind):
    """Drafters without a model, the target's first layers as draft, and max_new_tokens=1 (one target forward over
    the uncached tokens, nothing drafted)."""
    target, _ = pair
    ids, mask = left_padded([WIDTH, 7], seed=7)
    cache = prompt_cache(target, left_padded([WIDTH, 7], seed=8)[0][:, :5], mask[:, :5])
    drafting = {"max_new_tokens": NEW_TOKENS, **_drafting(kind, target)}
    settings = dict(attention_mask=mask, do_sample=False, max_new_tokens=drafting.pop("max_new_tokens"),
                    return_dict_in_generate=True, output_logits=True)
    expected = hf_generate(target, ids, past_key_values=copy.deepcopy(cache), **settings)
    got = sk.generate(target, ids, past_key_values=cache, **settings, **drafting)
    assert torch.equal(got.sequences, expected.sequences)  # (and the logits: see the padded test)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)


def test_session_start_takes_it(pair):
    target, draft = pair
    ids = left_padded([WIDTH], seed=9)[0]
    cache = prompt_cache(target, left_padded([WIDTH], seed=10)[0][:, :7])
    hf_cache = copy.deepcopy(cache)
    expected = hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=hf_cache)
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        ids, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=cache)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), expected)
    assert_extended_as_hf(cache, hf_cache)  # (when the session finished)


def test_dict_output_returns_the_callers_cache_and_the_statistics_count_the_uncached_prefill(pair):
    """As HF, the output's cache field is the caller's cache object, extended."""
    target, draft = pair
    ids = left_padded([WIDTH], seed=11)[0]
    cache = prompt_cache(target, left_padded([WIDTH], seed=12)[0][:, :8])
    hf_cache = copy.deepcopy(cache)
    expected = hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, past_key_values=hf_cache)
    out = sk.generate(target, ids, draft_model=draft, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, past_key_values=cache, prefill_chunk_size=1)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-4)
    assert getattr(expected, CACHE_FIELD) is hf_cache and getattr(out, CACHE_FIELD) is cache
    assert_extended_as_hf(cache, hf_cache)
    assert out.speculation_stats.prefill_forwards == WIDTH - 8 - 1  # tokens 8..10, one per chunk (11: verified)


def test_dict_output_without_a_cache_keeps_none(pair):
    target, draft = pair
    out = sk.generate(target, left_padded([WIDTH], seed=11)[0], draft_model=draft, max_new_tokens=4,
                      do_sample=False, return_dict_in_generate=True)
    assert getattr(out, CACHE_FIELD) is None


def _probs_with_cache(model, cache, prompt, warpers):
    """Exact probability of every NEW-token continuation of prompt [1, L] under HF's sampling, the prompt's first P
    tokens read from ``cache`` (P of them, forwarded no more): numpy [VOCAB**NEW] in itertools.product order."""
    import itertools
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    cached = cache.get_seq_length()
    ids = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    rows = copy.deepcopy(cache)
    rows.batch_repeat_interleave(len(seqs))
    with torch.no_grad():
        logits = model(ids[:, cached:], past_key_values=rows).logits.float()
    logp = torch.zeros(len(seqs), dtype=torch.float64)
    first = prompt.shape[1] - cached - 1  # the last prompt token's index among the forwarded ones
    for t in range(NEW):
        step = warpers(ids[:, : prompt.shape[1] + t], logits[:, first + t].clone())
        logp += torch.log_softmax(step.double(), dim=-1).gather(1, seqs[:, t: t + 1]).squeeze(1)
    return logp.exp().numpy()


def test_sampling_follows_the_targets_distribution_given_the_cache():
    """Sampled continuations are distributed as HF samples them from the target given the cache (a chi-square
    test over every 3-token continuation; without the cache the distribution is far from it)."""
    target, draft = peaky(0, 2), peaky(7, 1)
    prompt = torch.tensor([[1, 4, 3, 5]])
    cache = prompt_cache(target, torch.tensor([[2, 0, 5]]))
    warpers = hf_warpers(1.0, 0, 1.0)
    probs = _probs_with_cache(target, cache, prompt, warpers)
    unused = _probs_with_cache(target, DynamicCache(), prompt, warpers)
    assert 0.5 * np.abs(probs - unused).sum() > 0.2  # the test can tell a run that ignores the cache
    rows = 6000
    batch_cache = copy.deepcopy(cache)
    batch_cache.batch_repeat_interleave(rows)
    out = sk.generate(target, prompt.expand(rows, -1), draft_model=draft, num_speculative_tokens=2, do_sample=True,
                      max_new_tokens=NEW, pad_token_id=0, seed=5, past_key_values=batch_cache)
    new = out[:, prompt.shape[1]:].numpy()
    codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


def _edited(cache, keep=None, offloading=False):
    """A copy of ``cache`` whose last layer keeps its first ``keep`` tokens (None: all), marked offloaded or not
    (an offloaded DynamicCache is filled on CUDA only)."""
    edited = copy.deepcopy(cache)
    if keep is not None:
        last = edited.layers[-1]
        last.keys, last.values = last.keys[:, :, :keep], last.values[:, :, :keep]
    edited.offloading = offloading
    return edited


def _refused_call(case, target, draft):
    """(call kwargs, the words the ValueError must hold) of each refused case."""
    ids = left_padded([WIDTH], seed=13)[0]
    cache = prompt_cache(target, ids[:, :5])
    static = StaticCache(config=target.config, max_cache_len=40)
    with torch.no_grad():
        target(ids[:, :5], past_key_values=static)
    cases = {
        "static cache object": (dict(past_key_values=static), "StaticCache"),
        "cache_implementation": (dict(past_key_values=cache, cache_implementation="static"), "cache_implementation"),
        "compile": (dict(past_key_values=cache, compile=True), "compile=True"),
        "as long as the prompt": (dict(past_key_values=prompt_cache(target, ids)), "fewer tokens than the prompt"),
        "longer than the prompt": (dict(past_key_values=prompt_cache(target, torch.cat([ids, ids], 1))),
                                   "fewer tokens than the prompt"),
        "batch size": (dict(past_key_values=prompt_cache(target, ids[:, :5].expand(2, -1))), "rows"),
        "num_return_sequences": (dict(past_key_values=cache, num_return_sequences=2, do_sample=True),
                                 "num_return_sequences"),
        "layer count": (dict(past_key_values=prompt_cache(llama(layers=1), ids[:, :5])), "layers"),
        "layer count of an empty cache": (dict(past_key_values=DynamicCache(config=llama(layers=1).config)), "layers"),
        "both names": (dict(past_key_values=cache, cache=cache), "not both"),
        "layers of different lengths": (dict(past_key_values=_edited(cache, keep=3)), "different numbers of tokens"),
        "an empty layer": (dict(past_key_values=_edited(cache, keep=0)), "holds no tokens where other layers do"),
        "offloaded": (dict(past_key_values=_edited(cache, offloading=True)), "offloaded"),
    }
    kwargs, words = cases[case]
    return ids, {"draft_model": draft, "max_new_tokens": 4, **kwargs}, words


@pytest.mark.parametrize("case", ["static cache object", "cache_implementation", "compile", "as long as the prompt",
                                  "longer than the prompt", "batch size", "num_return_sequences", "layer count",
                                  "layer count of an empty cache",
                                  "both names", "layers of different lengths", "an empty layer", "offloaded"])
def test_refused_by_name(pair, case):
    target, draft = pair
    ids, kwargs, words = _refused_call(case, target, draft)
    name = "cache" if "cache" in kwargs and "past_key_values" not in kwargs else "past_key_values"
    with pytest.raises(ValueError, match=name) as error:
        sk.generate(target, ids, **kwargs)
    assert words in str(error.value)
    if case == "batch size":  # (the num_return_sequences hint only where it was passed)
        assert "num_return_sequences" not in str(error.value)


def test_sliding_window_layers_that_dropped_tokens_are_refused():
    target = more_families()["mistral"]()  # (a window of 4 tokens)
    ids = left_padded([WIDTH], seed=14)[0]
    cache = prompt_cache(target, ids[:, :7], config=True)
    with pytest.raises(ValueError, match="past_key_values's layer 0 is a sliding-window layer that has dropped"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=4, past_key_values=cache)


def test_encoder_decoder_refused_by_name():
    target = t5()
    source = torch.tensor([[5, 6, 7, 8]])
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        target(input_ids=source, decoder_input_ids=torch.tensor([[0, 9]]), past_key_values=cache)
    with pytest.raises(ValueError, match="past_key_values is not supported for encoder-decoder models"):
        sk.generate(target, source, draft_model=target, max_new_tokens=4, past_key_values=cache,
                    decoder_input_ids=torch.tensor([[0, 9, 10]]))


@pytest.mark.parametrize("config", [False, True])
def test_an_empty_cache_is_no_cache_and_is_filled_as_hf_fills_it(pair, config):
    """An unused DynamicCache() (HF fills it from the whole prompt): the output of a call without it, the cache
    filled as model.generate fills it (its layers made by update, as HF's forwards make them)."""
    target, draft = pair
    ids = left_padded([WIDTH], seed=15)[0]
    cache, hf_cache = (DynamicCache(config=target.config) if config else DynamicCache() for _ in range(2))
    expected = hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=hf_cache)
    got = sk.generate(target, ids, draft_model=draft, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache)
    assert torch.equal(got, hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False))
    assert torch.equal(got, expected)
    assert_extended_as_hf(cache, hf_cache)


def test_the_draft_prefills_the_whole_prompt_not_the_targets_cache(pair):
    """The caller's cache is the target's: only the target's runner starts from it; the draft's first forward is
    its prefill of the whole prompt (but its last token) from an empty cache at positions 0.., as without the cache.
    (A draft started from the cache too sees the cached tokens twice and proposes from that context: the tokens
    stay the target's, the speed-up is lost silently; tiny random models accept its drafts all the same.)"""
    target, draft = pair
    ids = left_padded([WIDTH], seed=25)[0]
    cache = prompt_cache(target, ids[:, :6])
    seen = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # (its name in transformers 5.24 / before)
        seen.append((cache.get_seq_length(), kwargs["position_ids"][0, 0].item(), kwargs["input_ids"].shape[1]))

    hook = draft.register_forward_pre_hook(sk.per_token_hook(record), with_kwargs=True)
    try:
        got = sk.generate(target, ids, draft_model=draft, max_new_tokens=NEW_TOKENS, do_sample=False,
                          past_key_values=cache)
    finally:
        hook.remove()
    assert seen[0] == (0, 0, WIDTH - 1)
    assert torch.equal(got, hf_generate(target, ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                        past_key_values=copy.deepcopy(prompt_cache(target, ids[:, :6]))))


def test_a_target_cache_short_of_the_extension_raises_before_writing_any_layer(pair):
    """An internal invariant (the batch-1 runner holds a slot for every token up to the last new one): were it
    broken, the caller's cache would be extended short, silently; it raises instead, with no layer written."""
    target, _ = pair
    ids = left_padded([WIDTH], seed=26)[0]
    cache = prompt_cache(target, ids[:, :2])
    snapshot = kv_snapshot(cache)
    runner_cache = RollbackCache(target.config)
    with torch.no_grad():
        target(ids[:, :3], past_key_values=runner_cache)  # (3 slots; the extension to 6 needs 6)
    with pytest.raises(RuntimeError, match="holds fewer than the 6 tokens past_key_values is to be extended to"):
        extend_caller_cache("past_key_values", cache, runner_cache, batch=1, cached=2, end=6)
    assert_untouched(cache, snapshot)
    assert extend_caller_cache("past_key_values", cache, runner_cache, batch=1, cached=2, end=3)
    assert cache.get_seq_length() == 3


def test_one_new_token_in_chunks_counts_the_uncached_chunks(pair):
    """max_new_tokens=1 (the target's one forward over the uncached tokens, in chunks of 1): the statistics count
    the chunks before the last (which gives the token) over the uncached tokens only, not over the whole prompt."""
    target, draft = pair
    ids = left_padded([WIDTH], seed=27)[0]
    cache = prompt_cache(target, ids[:, :8])
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=draft, max_new_tokens=1, do_sample=False, past_key_values=cache,
                      prefill_chunk_size=1, speculation_stats=stats)
    assert torch.equal(got, hf_generate(target, ids, max_new_tokens=1, do_sample=False,
                                        past_key_values=prompt_cache(target, ids[:, :8])))
    assert stats.prefill_forwards == WIDTH - 8 - 1  # tokens 8..10, one per chunk (11: the forward of the token)


def test_an_eos_inside_an_accepted_block_extends_the_cache_to_the_eos_only(pair):
    """The target as its own draft accepts every draft (blocks of gamma + 1 tokens): an EOS at each position of the
    continuation lands inside a block too, where the runner holds the block's slots past it. The caller's cache
    is extended as HF's, to the EOS (never with the slots verified past it)."""
    target, _ = pair
    ids = left_padded([WIDTH], seed=28)[0]
    cache = prompt_cache(target, ids[:, :5])
    plain = hf_generate(target, ids, max_new_tokens=8, do_sample=False, past_key_values=copy.deepcopy(cache))
    new = plain[0, WIDTH:].tolist()
    for position in range(1, 6):
        eos = new[position]
        if eos in new[:position]:
            continue
        ours, hf_cache = copy.deepcopy(cache), copy.deepcopy(cache)
        expected = hf_generate(target, ids, max_new_tokens=8, do_sample=False, eos_token_id=eos,
                               past_key_values=hf_cache)
        got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=4, max_new_tokens=8,
                          do_sample=False, eos_token_id=eos, past_key_values=ours)
        assert torch.equal(got, expected)
        assert_extended_as_hf(ours, hf_cache)
