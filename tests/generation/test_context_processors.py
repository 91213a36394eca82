"""HF's logits processors that read the tokens so far (repetition penalties, n-gram bans, bad words, sequence bias,
suppressed tokens, the exponential length penalty, a prefix_allowed_tokens_fn, a caller's logits_processor), applied
at every position of a speculative block (``generation/context_processors.py``): greedy token-identical to
``model.generate`` on every path, sampling distributed as the target's processed-then-warped distribution."""

import copy
import warnings

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, WatermarkingConfig
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import speculative_kernels as sk
from speculative_kernels import CompileOptions
from helpers.float_error import assert_logits_as_accurate_as_hf, processor_gain
from helpers.models import hf_generate, llama, perturbed
from helpers.sampling import NEW, VOCAB, continuation_probs, hf_chain_probs, peaky
from helpers.seq2seq_models import bart, t5
from helpers.stats import assert_matches

ONE = torch.tensor([[84, 39, 64, 30, 63, 11, 12]])
BATCH = torch.tensor([[0, 0, 84, 39, 64, 30, 63], [5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 3, 4, 5]])
BATCH_MASK = (BATCH != 0).long()
GREEDY = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)

# Each changes the greedy output of the pair below on BATCH (checked: the comparisons can fail).
SETTINGS = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "repetition_penalty_below_one": dict(repetition_penalty=0.7),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8], [56]]),
    "sequence_bias": dict(sequence_bias={(5,): -3.0, (62, 83): 4.0}),
    "suppress_tokens": dict(suppress_tokens=[62, 83]),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 1.5), eos_token_id=2),
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.5),
    "several, with min_new_tokens": dict(repetition_penalty=1.2, no_repeat_ngram_size=3, min_new_tokens=5,
                                        eos_token_id=2, suppress_tokens=[40]),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda b, ids: list(range(3, 40)) if b == 0
                                     else list(range(30, 97))),
    "watermarking_config": dict(watermarking_config=WatermarkingConfig(bias=4.0)),
    "watermarking_config selfhash": dict(watermarking_config=WatermarkingConfig(bias=4.0, seeding_scheme="selfhash")),
}


@pytest.fixture(scope="module")
def pair():
    return llama(), llama(layers=1, seed=3)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("drafting", ["draft_model", "prompt_lookup"])
def test_greedy_identical_to_model_generate(pair, name, drafting):
    target, draft = pair
    settings = SETTINGS[name]
    extra = dict(draft_model=draft, num_speculative_tokens=3) if drafting == "draft_model" else \
        dict(prompt_lookup_num_tokens=3)
    expected = hf_generate(target, BATCH, attention_mask=BATCH_MASK, **GREEDY, **settings)
    assert not torch.equal(expected, hf_generate(target, BATCH, attention_mask=BATCH_MASK, **GREEDY))
    got = _quiet(sk.generate, target, BATCH, attention_mask=BATCH_MASK, **GREEDY, **settings, **extra)
    assert torch.equal(got, expected)
    one = _quiet(sk.generate, target, ONE, **GREEDY, **settings, **extra)
    assert torch.equal(one, hf_generate(target, ONE, **GREEDY, **settings))


@pytest.mark.parametrize("path", ["static", "compile"])
def test_static_cache_and_compiled_loop(pair, path):
    target, draft = pair
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[56]])
    way = dict(cache_implementation="static") if path == "static" else dict(compile=CompileOptions(backend="eager"))
    expected = hf_generate(target, BATCH, attention_mask=BATCH_MASK, **GREEDY, **settings)
    got = _quiet(sk.generate, target, BATCH, attention_mask=BATCH_MASK, draft_model=draft, num_speculative_tokens=3,
                 **GREEDY, **settings, **way)
    assert torch.equal(got, expected)


def test_bfloat16_processed_in_float32_as_hf():
    """HF casts the logits to float32 before its processors; a penalty applied in bfloat16 rounds otherwise. Compared
    like with like: our own raw logits through HF's processors in float32 give exactly our scores, and each token is
    their argmax (token identity to model.generate is not the test in bfloat16, where forwards of different widths
    round differently: docs/half_precision.md)."""
    target, draft = llama().to(torch.bfloat16), llama(layers=1, seed=3).to(torch.bfloat16)
    settings = dict(repetition_penalty=1.07, no_repeat_ngram_size=3)
    out = _quiet(sk.generate, target, ONE, draft_model=draft, **GREEDY, **settings, eos_token_id=None,
                 output_scores=True, output_logits=True, return_dict_in_generate=True)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.07), NoRepeatNGramLogitsProcessor(3)])
    width = ONE.shape[1]
    assert len(out.scores) == GREEDY["max_new_tokens"]
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores)):
        assert raw.dtype == scores.dtype == torch.float32
        assert torch.equal(scores, processors(out.sequences[:, : width + step], raw.float()))
        assert torch.equal(out.sequences[:, width + step], scores.argmax(dim=-1))
    # the check can fail: the same penalty applied in bfloat16 rounds to other scores
    raw = out.logits[1]
    in_bf16 = processors(out.sequences[:, : width + 1], raw.to(torch.bfloat16)).float()
    assert not torch.equal(in_bf16, processors(out.sequences[:, : width + 1], raw.float()))


def test_the_model_generation_config_default_is_honoured(pair):
    """A checkpoint whose generation_config.json sets repetition_penalty (e.g. the Qwen2.5 instruct models, 1.05):
    ``sk.generate(model, ids)`` applies it as ``model.generate`` does; it was refused."""
    target, draft = pair
    model = copy.deepcopy(target)
    model.generation_config.repetition_penalty = 1.4
    expected = hf_generate(model, BATCH, attention_mask=BATCH_MASK, **GREEDY)
    assert not torch.equal(expected, hf_generate(target, BATCH, attention_mask=BATCH_MASK, **GREEDY))
    got = _quiet(sk.generate, model, BATCH, attention_mask=BATCH_MASK, draft_model=draft, **GREEDY)
    assert torch.equal(got, expected)


def test_scores_processed_and_renormalised_as_hf(pair):
    """output_scores: the processed logits (log-softmax normalised last with renormalize_logits), per position."""
    target, draft = pair
    settings = dict(repetition_penalty=1.3, renormalize_logits=True, return_dict_in_generate=True,
                    output_scores=True, output_logits=True)
    expected = hf_generate(target, ONE, **GREEDY, **settings)
    got = _quiet(sk.generate, target, ONE, draft_model=draft, **GREEDY, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    for mine, theirs in zip(got.scores, expected.scores):  # both log-probabilities: sum(exp) == 1
        torch.testing.assert_close(mine.exp().sum(-1), torch.ones(1))
        assert torch.equal(torch.isfinite(mine), torch.isfinite(theirs))
    # the values: HF's own float error of the logits (against float64), times what the penalty and the log-softmax
    # can amplify it by
    gain = processor_gain(GenerationConfig(repetition_penalty=1.3, renormalize_logits=True), len(expected.scores))
    assert_logits_as_accurate_as_hf(target, got, expected, score_gain=gain)


class _Ban(LogitsProcessor):
    """A caller's processor: bans the token that follows the last one in a fixed table (reads the sequence)."""

    def __call__(self, input_ids, scores):
        banned = (input_ids[:, -1] * 7 + 3) % scores.shape[-1]
        return scores.scatter(1, banned.unsqueeze(1), float("-inf"))


def test_callers_logits_processor_at_batch_one(pair):
    target, draft = pair
    processors = LogitsProcessorList([_Ban(), RepetitionPenaltyLogitsProcessor(1.2)])
    expected = hf_generate(target, ONE, **GREEDY, logits_processor=processors)
    assert not torch.equal(expected, hf_generate(target, ONE, **GREEDY))
    for extra in (dict(draft_model=draft), dict(prompt_lookup_num_tokens=4)):
        assert torch.equal(_quiet(sk.generate, target, ONE, **GREEDY, logits_processor=processors, **extra), expected)


def test_a_callers_processor_replaces_hf_own_of_its_type(pair):
    """HF's ``_merge_criteria_processor_list``: a MinLengthLogitsProcessor in logits_processor replaces the one
    min_length builds (ours used to apply both)."""
    target, draft = pair
    eos = int(hf_generate(target, ONE, max_new_tokens=3, do_sample=False, pad_token_id=0)[0, -1])
    processors = LogitsProcessorList([MinLengthLogitsProcessor(ONE.shape[1] + 1, eos)])
    kwargs = dict(GREEDY, eos_token_id=eos, min_length=ONE.shape[1] + 12)
    expected = hf_generate(target, ONE, **kwargs, logits_processor=processors)
    assert expected.shape[1] < ONE.shape[1] + 12  # the caller's shorter minimum won
    assert torch.equal(_quiet(sk.generate, target, ONE, draft_model=draft, **kwargs, logits_processor=processors),
                       expected)


def test_a_callers_min_length_processor_leaves_min_new_tokens_in_force(pair):
    """min_new_tokens: HF builds a MinLengthLogitsProcessor (min_length = prompt + min_new_tokens) and a
    MinNewTokensLengthLogitsProcessor; a caller's MinLengthLogitsProcessor replaces only the first, so EOS still
    waits min_new_tokens. (Ours folded the minimum into min_length alone, which the caller's replaced: an early
    EOS.)"""
    target, draft = pair
    new = hf_generate(target, ONE, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ONE.shape[1]:].tolist()
    eos = new[2]  # the third new token: the first place min_new_tokens=4 changes
    kwargs = dict(GREEDY, eos_token_id=eos, min_new_tokens=4,
                  logits_processor=LogitsProcessorList([MinLengthLogitsProcessor(ONE.shape[1] + 1, eos)]))
    expected = hf_generate(target, ONE, **kwargs)
    assert eos not in expected[0, ONE.shape[1]:ONE.shape[1] + 4].tolist()
    assert torch.equal(_quiet(sk.generate, target, ONE, draft_model=draft, **kwargs), expected)


def test_callers_logits_processor_refused_for_a_batch(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="logits_processor with a batch of 3 prompts"):
        sk.generate(target, BATCH, attention_mask=BATCH_MASK, draft_model=draft, **GREEDY,
                    logits_processor=LogitsProcessorList([_Ban()]))
    with pytest.raises(TypeError, match="logits_processor must hold callables"):
        sk.generate(target, ONE, draft_model=draft, **GREEDY, logits_processor=[3])
    with pytest.raises(TypeError, match="prefix_allowed_tokens_fn must be callable"):
        sk.generate(target, ONE, draft_model=draft, **GREEDY, prefix_allowed_tokens_fn=[3])


def test_a_callers_processor_returning_its_row_as_a_vector_is_taken_as_model_generate_takes_it(pair):
    """A processor returning ``scores[0]`` ([V], a view of the row it was given): model.generate's greedy choice reads
    it as it is; ours failed inside torch writing the view back over its own row (overlapping memory)."""
    target, draft = pair

    def banned_as_vector(input_ids, scores):
        return _Ban()(input_ids, scores)[0]

    def vector_view(input_ids, scores):
        return scores[0]

    for processor in (banned_as_vector, vector_view):
        expected = hf_generate(target, ONE, **GREEDY, logits_processor=LogitsProcessorList([processor]))
        for extra in (dict(draft_model=draft), dict(prompt_lookup_num_tokens=4)):
            got = _quiet(sk.generate, target, ONE, **GREEDY, logits_processor=LogitsProcessorList([processor]),
                         **extra)
            assert torch.equal(got, expected)


def test_a_callers_function_with_a_defaulted_third_parameter_runs_as_in_model_generate(pair):
    """HF's LogitsProcessorList reads a processor's ``__call__``: a plain function's is (*args, **kwargs), so it is
    called with (input_ids, scores) and its own defaults; ours read the function's parameters and refused it."""
    target, draft = pair

    def ban_the_top(input_ids, scores, how_many=1):
        for _ in range(how_many):
            scores = scores.scatter(1, scores.argmax(-1, keepdim=True), float("-inf"))
        return scores

    expected = hf_generate(target, ONE, **GREEDY, logits_processor=LogitsProcessorList([ban_the_top]))
    assert not torch.equal(expected, hf_generate(target, ONE, **GREEDY))
    got = _quiet(sk.generate, target, ONE, draft_model=draft, **GREEDY,
                 logits_processor=LogitsProcessorList([ban_the_top]))
    assert torch.equal(got, expected)



def test_a_callers_processor_that_needs_more_arguments_is_refused_by_name(pair):
    """generate passes a processor (input_ids, scores) alone, as model.generate does: a LogitsProcessor whose
    ``__call__`` takes more (HF's LogitsProcessorList refuses it, with a default too) and a function that requires a third argument
    (it fails when called) are refused by name before anything runs; a function taking more positional arguments
    optionally (``*rest``) runs as in model.generate."""
    target, draft = pair

    class NeedsLength(LogitsProcessor):
        def __call__(self, input_ids, scores, cur_len=0):  # (HF's list refuses it, default or not)
            return scores

    def needs_length(input_ids, scores, cur_len):
        return scores

    def ban_the_top(input_ids, scores, *rest):
        return scores.scatter(1, scores.argmax(-1, keepdim=True), float("-inf"))

    for processor, name in ((NeedsLength(), "NeedsLength"), (needs_length, "needs_length")):
        with pytest.raises(ValueError, match=f"logits processor {name} takes more arguments than"):
            sk.generate(target, ONE, draft_model=draft, **GREEDY, logits_processor=[processor])
    expected = hf_generate(target, ONE, **GREEDY, logits_processor=LogitsProcessorList([ban_the_top]))
    got = _quiet(sk.generate, target, ONE, draft_model=draft, **GREEDY,
                 logits_processor=LogitsProcessorList([ban_the_top]))
    assert torch.equal(got, expected)

def test_a_callers_processor_returning_no_scores_row_is_named(pair):
    """None (a processor without ``return scores``) or another width: model.generate fails inside torch (or, for a
    narrower row, picks among the first ids only); the error here names the processor."""
    target, draft = pair

    def forgets_to_return(input_ids, scores):
        scores[:, 0] = float("-inf")

    def drops_the_last_id(input_ids, scores):
        return scores[:, :-1]

    class ForgetfulWarper(LogitsProcessor):  # (a warper by HF's naming: run on the rows with a distribution)
        def __call__(self, input_ids, scores):
            forgets_to_return(input_ids, scores)

    with pytest.raises(TypeError, match="logits processor forgets_to_return returned NoneType"):
        sk.generate(target, ONE, draft_model=draft, **GREEDY, logits_processor=[forgets_to_return])
    with pytest.raises(TypeError, match="logits processor ForgetfulWarper returned NoneType"):
        sk.generate(target, ONE, draft_model=draft, **GREEDY, logits_processor=[ForgetfulWarper()])
    narrower = target.config.vocab_size - 1
    with pytest.raises(ValueError, match=rf"drops_the_last_id returned scores of shape \(1, {narrower}\)"):
        sk.generate(target, ONE, draft_model=draft, **GREEDY, logits_processor=[drops_the_last_id])

    def answers_for_two_rows(input_ids, scores):
        return scores.expand(2, -1)

    with pytest.raises(ValueError, match=r"answers_for_two_rows returned scores of shape \(2, \d+\), not \[1, \d+\]"):
        sk.generate(target, ONE, draft_model=draft, **GREEDY, logits_processor=[answers_for_two_rows])

    def transposes(input_ids, scores):  # ([V, 1]: as many values, V rows of one; model.generate fails on it)
        return scores.T

    with pytest.raises(ValueError, match=r"transposes returned scores of shape \(\d+, 1\), not \[1, \d+\]"):
        sk.generate(target, ONE, draft_model=draft, **GREEDY, logits_processor=[transposes])


@pytest.mark.parametrize("make", [t5, bart])
def test_encoder_decoder(make):
    target = make()
    draft = make(layers=1, seed=5)
    source = torch.tensor([[12, 40, 7, 7, 33, 21, 5], [40, 12, 9, 33, 0, 0, 0]])
    mask = torch.tensor([[1] * 7, [1, 1, 1, 1, 0, 0, 0]])
    if make is bart:
        source = source.masked_fill(mask == 0, 1)  # BART pads with 1
    settings = dict(repetition_penalty=1.5, encoder_repetition_penalty=1.3, no_repeat_ngram_size=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    expected = hf_generate(target, source, **kwargs, **settings)
    assert not torch.equal(expected, hf_generate(target, source, **kwargs))
    got = _quiet(sk.generate, target, source, draft_model=draft, num_speculative_tokens=3, **kwargs, **settings)
    assert torch.equal(got, expected)


def test_decoder_start_honours_processors(pair):
    target, draft = pair
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=2)
    decoder = sk.SpeculativeDecoder(target, draft)
    session = _quiet(decoder.start, BATCH, attention_mask=BATCH_MASK, **GREEDY, **settings)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), hf_generate(target, BATCH, attention_mask=BATCH_MASK, **GREEDY, **settings))


@pytest.mark.parametrize("gamma", [1, 2])  # (NEW = 3 tokens: any gamma >= 2 drafts 2, as gamma 2 does)
def test_sampling_follows_the_processed_distribution(gamma):
    """Whole continuations (NEW tokens, every one enumerated) under repetition penalty, an n-gram ban, temperature
    and top-k: chi-square against HF's processors-then-warpers distribution."""
    target, draft = peaky(0, 2), peaky(7, 1)
    prompt = torch.tensor([[1, 4, 3, 5]])
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0), NoRepeatNGramLogitsProcessor(2),
                                      TemperatureLogitsWarper(1.3), TopKLogitsWarper(4)])
    _, probs = continuation_probs(target, prompt, processors)
    rows = 1500
    torch.manual_seed(4321)
    out = _quiet(sk.generate, target, prompt.expand(rows, -1), draft_model=draft, num_speculative_tokens=gamma,
                 do_sample=True, temperature=1.3, top_k=4, repetition_penalty=3.0, no_repeat_ngram_size=2,
                 max_new_tokens=NEW, pad_token_id=0)
    new = out[:, prompt.shape[1]:].numpy()
    codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    counts = np.bincount(codes, minlength=VOCAB**NEW)
    plain = continuation_probs(target, prompt, LogitsProcessorList([TemperatureLogitsWarper(1.3),
                                                                    TopKLogitsWarper(4)]))[1]
    assert np.abs(probs - plain).sum() > 0.3  # the processors change the distribution: the test can fail
    assert_matches(counts, probs)


@pytest.mark.parametrize("warpers", [dict(min_p=0.2), dict(typical_p=0.6, top_k=5), dict(epsilon_cutoff=0.1),
                                     dict(eta_cutoff=0.1, top_p=0.9)])
def test_sampling_warpers_the_ops_lack(warpers):
    """min_p, typical_p, epsilon/eta cutoffs: HF's whole warper chain runs before the verification (chi-square of
    whole continuations against HF's temperature-then-warpers distribution)."""
    target, draft = peaky(0, 2), peaky(7, 1)
    prompt = torch.tensor([[1, 4, 3, 5]])
    settings = dict(temperature=1.4, **warpers)
    hf = target._get_logits_processor(generation_config=copy.deepcopy(target.generation_config).__class__(
        do_sample=True, **settings), input_ids_seq_length=prompt.shape[1], device="cpu", model_kwargs={})
    _, probs = continuation_probs(target, prompt, hf)
    plain = continuation_probs(target, prompt, LogitsProcessorList(
        [TemperatureLogitsWarper(1.4)] + ([TopKLogitsWarper(5)] if "top_k" in warpers else [])))[1]
    assert np.abs(probs - plain).sum() > 0.05  # the warper changes the distribution: the test can fail
    torch.manual_seed(99)
    out = _quiet(sk.generate, target, prompt.expand(1500, -1), draft_model=draft, num_speculative_tokens=2,
                 do_sample=True, max_new_tokens=NEW, pad_token_id=0, **settings)
    codes = (out[:, prompt.shape[1]:].numpy() * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


def test_sampling_with_a_watermark_follows_hf_order():
    """A watermark (Kirchenbauer et al.) reads the tokens so far and comes after temperature and top-k in HF's chain:
    chi-square of whole continuations against HF's processors-warpers-watermark distribution, which the watermark
    placed before the warpers would not give (checked: the test can fail on the order)."""
    from transformers.generation.logits_process import WatermarkLogitsProcessor

    target, draft = peaky(0, 2), peaky(7, 1)
    prompt = torch.tensor([[1, 4, 3, 5]])
    settings = dict(temperature=1.3, top_k=4, watermarking_config=WatermarkingConfig(bias=6.0))
    hf = target._get_logits_processor(generation_config=GenerationConfig(do_sample=True, **settings),
                                      input_ids_seq_length=prompt.shape[1], device="cpu", model_kwargs={})
    assert isinstance(hf[-1], WatermarkLogitsProcessor)  # HF's order: the watermark last
    _, probs = continuation_probs(target, prompt, hf)
    before = continuation_probs(target, prompt, LogitsProcessorList([hf[-1], *hf[:-1]]))[1]
    assert np.abs(probs - before).sum() > 0.5  # (measured 0.67; HF's processor is per row: 400 rows keep it short)
    torch.manual_seed(7)
    out = _quiet(sk.generate, target, prompt.expand(400, -1), draft_model=draft, num_speculative_tokens=2,
                 do_sample=True, max_new_tokens=NEW, pad_token_id=0, **settings)
    codes = (out[:, prompt.shape[1]:].numpy() * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


def test_stateful_watermark_refused(pair):
    """SynthID's processor keeps state from call to call, which calls at rejected positions would advance."""
    from transformers import SynthIDTextWatermarkingConfig

    target, draft = pair
    config = SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123], ngram_len=3)
    with pytest.raises(ValueError, match="watermarking_config=SynthIDTextWatermarkingConfig"):
        sk.generate(target, ONE, draft_model=draft, max_new_tokens=4, watermarking_config=config)


def test_watermark_dict_set_on_a_config_is_a_type_error(pair):
    """GenerationConfig converts a watermarking_config dict in its constructor and as generate's keyword (both
    accepted here too), not when set as an attribute, where HF fails with an AttributeError deep inside."""
    target, draft = pair
    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    config.watermarking_config = {"bias": 2.0}
    with pytest.raises(TypeError, match="watermarking_config must be a transformers WatermarkingConfig"):
        sk.generate(target, ONE, draft_model=draft, generation_config=config)
    expected = hf_generate(target, ONE, **GREEDY, watermarking_config={"bias": 2.0})
    assert torch.equal(_quiet(sk.generate, target, ONE, draft_model=draft, **GREEDY,
                              watermarking_config={"bias": 2.0}), expected)


def test_watermark_dict_on_the_models_own_config_is_applied_as_hf_applies_it():
    """On the model's own generation_config (set as an attribute, or loaded that way) HF converts a dict when it
    prepares the call's config, and applies the watermark; it was refused here with a TypeError."""
    target, draft = llama(), llama(layers=1, seed=2)
    target.generation_config.watermarking_config = {"bias": 8.0, "context_width": 1}
    expected = hf_generate(target, ONE, **GREEDY)
    assert not torch.equal(expected, hf_generate(llama(), ONE, **GREEDY))  # (the watermark changes the tokens)
    assert torch.equal(_quiet(sk.generate, target, ONE, draft_model=draft, **GREEDY), expected)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    session = decoder.start(ONE, max_new_tokens=20, do_sample=False, pad_token_id=0)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), expected)
    with pytest.raises(ValueError, match="watermarking_config \\(from the model's generation config\\) is not "
                                         "supported by add_request"):  # (refused there by name)
        decoder.add_request(ONE[0].tolist(), max_new_tokens=4)


def test_warpers_change_nothing_when_greedy_as_in_hf(pair):
    target, draft = pair
    expected = hf_generate(target, ONE, **GREEDY, min_p=0.3, typical_p=0.5)
    assert torch.equal(expected, hf_generate(target, ONE, **GREEDY))
    assert torch.equal(_quiet(sk.generate, target, ONE, draft_model=draft, **GREEDY, min_p=0.3, typical_p=0.5),
                       expected)
    with pytest.raises(ValueError, match="min_p"):  # HF's own check of the value, by name
        sk.generate(target, ONE, draft_model=draft, max_new_tokens=4, do_sample=True, min_p=1.5)


@pytest.mark.parametrize("drafting", ["draft_model", "prompt_lookup"])
def test_begin_suppress_tokens_acts_at_the_first_position_only(pair, drafting):
    """HF's SuppressTokensAtBeginLogitsProcessor fires where input_ids.shape[-1] equals the prompt's width: at the
    first new token only. Suppressing the tokens plain greedy decoding starts with changes the output (the check
    can fail), and a context one token off at the first position would suppress nothing."""
    target, draft = pair
    plain = hf_generate(target, BATCH, attention_mask=BATCH_MASK, **GREEDY)
    first = sorted(set(plain[:, BATCH.shape[1]].tolist()))
    settings = dict(begin_suppress_tokens=first)
    expected = hf_generate(target, BATCH, attention_mask=BATCH_MASK, **GREEDY, **settings)
    assert not torch.equal(expected, plain)
    extra = dict(draft_model=draft, num_speculative_tokens=3) if drafting == "draft_model" else \
        dict(prompt_lookup_num_tokens=3)
    assert torch.equal(_quiet(sk.generate, target, BATCH, attention_mask=BATCH_MASK, **GREEDY, **settings, **extra),
                       expected)


@pytest.mark.parametrize("drafting", ["draft_model", "ngram"])
def test_sampling_warpers_in_a_batch_whose_rows_finish_apart(drafting):
    """min_p and typical_p (warpers the ops lack: HF's chain warps the logits first) in a batch of two prompts, one
    left-padded, with a repetition penalty: rows reach max_new_tokens at different iterations and finished rows
    leave the batch. The shared warper chain had no select_rows, so the first drop raised AttributeError. Each
    prompt's continuations: chi-square against HF's own chain for that row (its padding ignored by the penalty
    where the installed transformers does so)."""
    target = peaky(0, 2)
    prompts = [torch.tensor([[1, 4, 3, 5]]), torch.tensor([[0, 4, 4, 2]])]
    masks = [torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 1]])]
    rows = 1000
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=4, min_p=0.1, typical_p=0.7,
                              repetition_penalty=1.5, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
    extra = (dict(draft_model=perturbed(target, 0.1), num_speculative_tokens=2) if drafting == "draft_model"
             else dict(drafter=sk.NGramDrafter(VOCAB)))
    stats = sk.SpeculationStats()
    torch.manual_seed(2024)
    out = _quiet(sk.generate, target, torch.cat([p.expand(rows, -1) for p in prompts]),
                 attention_mask=torch.cat([m.expand(rows, -1) for m in masks]),
                 generation_config=copy.deepcopy(config), speculation_stats=stats,
                 batching=sk.BatchingOptions(drop_finished_fraction=0.01), **extra)
    assert stats.dropped_rows > 0  # finished rows did leave the batch
    for i, (prompt, mask) in enumerate(zip(prompts, masks)):
        new = out[i * rows : (i + 1) * rows, prompt.shape[1] :].numpy()
        codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
        assert_matches(np.bincount(codes, minlength=VOCAB**NEW), hf_chain_probs(target, prompt, mask, config))


def test_warpers_pass_rows_without_a_distribution_through():
    """A block holds positions past drafts the target bans, where the processors may ban every token; HF's generate
    never samples there, but some warpers raise on such a row (transformers 5.17's eta and top-H warpers validate a
    torch Categorical). The chain warps the valid rows and passes the others through unchanged, for verification to
    flag if reached."""
    from speculative_kernels.generation.context_processors import Warpers

    class StrictWarper(LogitsProcessor):  # validates its input, as torch.distributions.Categorical does
        def __call__(self, input_ids, scores):
            if not torch.isfinite(scores).any(dim=-1).all():
                raise ValueError("a row without a finite logit")
            return scores - 1.0

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[[0.0, 1.0, -inf], [-inf] * 3], [[2.0, 0.0, 0.0], [0.0, nan, 1.0]]])
    out = Warpers([StrictWarper()])(logits)
    assert torch.equal(out[0, 0], logits[0, 0] - 1.0) and torch.equal(out[1, 0], logits[1, 0] - 1.0)
    assert torch.equal(out[0, 1], logits[0, 1]) and torch.isnan(out[1, 1, 1])  # passed through as they were


def test_sampling_with_eta_cutoff_past_banned_drafts():
    """The randomized sampling check's case that failed under transformers 5.17 (its eta warper raised on a block
    position whose every token the processors banned, past a prompt-lookup draft the target bans): it runs, and each
    prompt follows HF's chain."""
    from helpers import sampling_differential as sweep

    target, draft = sweep.models("llama")
    case = dict(seed=33, family="llama", eos="eos", drafting="prompt_lookup", gamma=3, settings=dict(
        temperature=1.4, min_p=0.1, epsilon_cutoff=0.05, eta_cutoff=0.05, no_repeat_ngram_size=2, suppress_tokens=[3],
        begin_suppress_tokens=[1], sequence_bias={(2,): 2.0}, bad_words_ids=[[2, 5]], renormalize_logits=True,
        min_new_tokens=1, exponential_decay_length_penalty=(1, 1.5), min_length="+2"))
    sweep.check_case(case, target, draft)


def test_a_batch_shares_one_watermark_processor(pair, monkeypatch):
    """Each row's processor list had its own HF watermark processor, each building an 8 MB random table (300 rows:
    2.4 GB more peak memory than model.generate; 4000 rows were killed out of memory): the rows share row 0's, at
    its place in HF's order, and the output is model.generate's."""
    from transformers.generation.logits_process import WatermarkLogitsProcessor

    from speculative_kernels.generation import request
    from helpers.prompts import left_padded

    target, draft = pair
    ids, mask = left_padded([5, 8, 3], seed=2)
    settings = dict(watermarking_config=WatermarkingConfig(bias=4.0), max_new_tokens=8, do_sample=False,
                    pad_token_id=0)
    built = []
    real = request.build_row_processors

    def recording(*args, **kwargs):
        processors = real(*args, **kwargs)
        built.append([list(row) for row in processors.rows])  # (as built: finished rows leave the lists later)
        return processors

    monkeypatch.setattr(request, "build_row_processors", recording)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, **settings)
    rows = built[0]
    watermarks = {id(p) for row in rows for p in row if isinstance(p, WatermarkLogitsProcessor)}
    assert len(rows) == 3 and len(watermarks) == 1
    assert [[type(p) for p in row] for row in rows[1:]] == [[type(p) for p in rows[0]]] * 2
    assert torch.equal(got, _quiet(target.generate, ids, attention_mask=mask, **settings))


def test_a_batch_shares_its_bias_processors(pair, monkeypatch):
    """bad_words_ids / sequence_bias built one [V] float32 bias table per row (B times model.generate's): the rows
    share row 0's processors (settings only, no per-row state), and the output is model.generate's."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

    from speculative_kernels.generation import request
    from helpers.prompts import left_padded

    target, draft = pair
    ids, mask = left_padded([5, 8, 3], seed=2)
    settings = dict(bad_words_ids=[[5], [7, 8]], sequence_bias={(9,): -2.0}, max_new_tokens=8, do_sample=False,
                    pad_token_id=0)
    built = []
    real = request.build_row_processors

    def recording(*args, **kwargs):
        processors = real(*args, **kwargs)
        built.append([list(row) for row in processors.rows])
        return processors

    monkeypatch.setattr(request, "build_row_processors", recording)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, **settings)
    rows = built[0]
    for kind in (NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor):
        assert len({id(p) for row in rows for p in row if type(p) is kind}) == 1
    assert torch.equal(got, _quiet(target.generate, ids, attention_mask=mask, **settings))


def _trie_fn(prompt_length):
    """Constrained decoding as HF documents it (GENRE-style): a trie of allowed continuations, each ending with
    EOS; defined on the trie's own prefixes only (KeyError elsewhere)."""
    trie = {}
    for entry in ([20, 21, 22, 23, 2], [20, 30, 31, 2], [40, 41, 2]):
        for i in range(len(entry)):
            trie.setdefault(tuple(entry[:i]), set()).add(entry[i])
    return trie, lambda batch_id, ids: sorted(trie[tuple(ids[prompt_length:].tolist())])


def test_a_prefix_fn_defined_on_valid_prefixes_only_is_exact():
    """HF calls prefix_allowed_tokens_fn only on prefixes its own allowed tokens built; here the processors also see
    contexts holding drafts the target may reject, where a trie lookup raises KeyError (and HF's processor raises
    on an empty list, or its selfhash watermark on some contexts): the call failed where model.generate returns.
    A row whose processors raise at a position past its first verifies only the drafts before it (the iteration
    it would run with fewer drafts); on its real tokens the error still propagates."""
    target, draft = llama(), llama(layers=1, seed=3)
    ids = torch.tensor([[11, 12, 13, 14]])
    trie, allowed = _trie_fn(ids.shape[1])
    kwargs = dict(max_new_tokens=8, prefix_allowed_tokens_fn=allowed, eos_token_id=2, pad_token_id=0)
    expected = hf_generate(target, ids, do_sample=False, **kwargs)
    for drafting in (dict(draft_model=draft, num_speculative_tokens=3), dict(prompt_lookup_num_tokens=3)):
        stats = sk.SpeculationStats()
        got = _quiet(sk.generate, target, ids, do_sample=False, speculation_stats=stats, **drafting, **kwargs)
        assert torch.equal(got, expected)
        assert stats.drafted_tokens <= 3 * stats.target_forwards
    sampled = [_quiet(sk.generate, target, ids, draft_model=draft, num_speculative_tokens=3, do_sample=True,
                      seed=seed, **kwargs)[0, ids.shape[1]:].tolist() for seed in range(6)]
    for tokens in sampled:  # every sampled continuation is one of the trie's
        assert all(token in trie[tuple(tokens[:i])] for i, token in enumerate(tokens))
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(ids, do_sample=False, **kwargs)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), expected)
    with pytest.raises(KeyError):  # the real context off the trie: raised as model.generate raises it
        _quiet(sk.generate, target, ids, draft_model=draft, do_sample=False, **{
            **kwargs, "prefix_allowed_tokens_fn": lambda batch_id, ids: {}[0]})


@pytest.mark.parametrize("gamma", [1, 2])  # (NEW = 3 tokens: any gamma >= 2 drafts 2, as gamma 2 does)
def test_sampling_with_a_prefix_fn_defined_on_valid_prefixes_only(gamma):
    """The same trie constraint when sampling: a row whose function raises at a drafted position verifies the
    drafts before it and emits from processed positions only. Chi-square of whole continuations against HF's
    constrained distribution. The draft is near-uniform: it proposes off-trie tokens (which raise) and trie tokens
    in other proportions than the target's, so skipping a draft that raised without its rejection's residual would
    bias the first token by about q(off-trie) * (p - residual)."""
    target, draft = peaky(0, 2), llama(layers=1, vocab=VOCAB, seed=7)
    prompt = torch.tensor([[1, 4, 3, 5]])
    length = prompt.shape[1]
    trie = {}
    for entry in ([1, 2, 3], [1, 2, 5], [1, 4, 0], [3, 0, 2], [3, 5, 5], [4, 4, 4], [0, 1, 1]):
        for i in range(len(entry)):
            trie.setdefault(tuple(entry[:i]), set()).add(entry[i])
    raised = []

    def allowed(batch_id, ids):
        key = tuple(ids[length:].tolist())
        if key not in trie:
            raised.append(key)
        return sorted(trie[key])

    def enumerable(batch_id, ids):  # (off the trie: anything; such a prefix already has probability 0)
        return sorted(trie.get(tuple(ids[length:].tolist()), range(VOCAB)))

    constraint = LogitsProcessorList([PrefixConstrainedLogitsProcessor(enumerable, 1), TemperatureLogitsWarper(4.0)])
    _, probs = continuation_probs(target, prompt, constraint)
    rows = 1200
    out = _quiet(sk.generate, target, prompt.expand(rows, -1), draft_model=draft, num_speculative_tokens=gamma,
                 do_sample=True, temperature=4.0, prefix_allowed_tokens_fn=allowed, max_new_tokens=NEW,
                 pad_token_id=0, seed=11)
    new = out[:, length:].numpy()
    counts = np.bincount((new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1), minlength=VOCAB**NEW)
    assert len(raised) > rows  # the function raised on drafted contexts: the case is exercised
    assert (probs > 0).sum() == 7 and probs.max() < 0.5  # (several trie paths are likely: the test can fail)
    assert_matches(counts, probs)


def test_a_processor_that_raises_on_a_context_model_generate_reaches_raises_here_too():
    """A processor raising on a context that greedy decoding does reach: model.generate raises there. Here a block
    that accepts the draft completing that context drops the token drawn at the unprocessed position after it, and
    the next iteration processes the context as a real one: the same error, not a quiet continuation."""
    target = llama()
    ids = torch.tensor([[11, 12, 13, 14]])
    plain = hf_generate(target, ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    poison = plain[3]

    class Raising(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids[0, -1].item() == poison and input_ids.shape[1] > ids.shape[1]:
                raise RuntimeError("poisoned context")
            return scores

    class Collect:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens += value.flatten().tolist()

        def end(self):
            pass

    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([Raising()]))
    theirs, ours = Collect(), Collect()
    with pytest.raises(RuntimeError, match="poisoned context"):
        hf_generate(target, ids, streamer=theirs, **kwargs)
    with pytest.raises(RuntimeError, match="poisoned context"):  # the target as its draft: every draft accepted
        _quiet(sk.generate, target, ids, draft_model=target, num_speculative_tokens=5, streamer=ours, **kwargs)
    assert theirs.tokens[ids.shape[1]:] == plain[: plain.index(poison) + 1]  # (HF: up to the poisoned context)
    assert ours.tokens == theirs.tokens  # (the block was not lost: its tokens up to there were emitted)


def test_a_processor_that_edits_in_place_then_raises_and_alpha_counts_the_accepted_drafts():
    """A processor that writes its scores in place before it raises (a trie written in place) left the capped
    position half-processed (all -inf), which the verification flagged as an invalid row: the call failed where
    model.generate returns. And a row that accepted all j drafts before its processors raised at j (its next token
    dropped) was booked a failed accept test: alpha read 0.5 where both drafts passed."""
    target = llama()
    ids = torch.tensor([[5, 40, 41, 2, 7, 8, 9]])
    length = ids.shape[1]
    trie = {(): {40}, (40,): {41}, (40, 41): {2}}

    class InPlaceTrie(LogitsProcessor):
        def __call__(self, input_ids, scores):
            kept = scores.clone()
            scores.fill_(-float("inf"))
            allowed = sorted(trie[tuple(input_ids[0, length:].tolist())])  # KeyError off the trie
            scores[:, allowed] = kept[:, allowed]
            return scores

    kwargs = dict(max_new_tokens=8, eos_token_id=2, pad_token_id=0, do_sample=False)
    in_place = dict(kwargs, logits_processor=LogitsProcessorList([InPlaceTrie()]))
    expected = hf_generate(target, ids, **in_place)
    assert expected[0, length:].tolist() == [40, 41, 2]
    for drafting in (dict(prompt_lookup_num_tokens=3), dict(draft_model=target, num_speculative_tokens=3)):
        assert torch.equal(_quiet(sk.generate, target, ids, **drafting, **in_place), expected)
    stats = sk.SpeculationStats()  # prompt lookup drafts [41, 2] after 40: both pass, then the trie ends
    got = _quiet(sk.generate, target, ids, prompt_lookup_num_tokens=3, speculation_stats=stats, **kwargs,
                 prefix_allowed_tokens_fn=lambda batch_id, seq: sorted(trie[tuple(seq[length:].tolist())]))
    assert torch.equal(got, expected)
    assert (stats.accept_tests, stats.accept_tests_passed) == (2, 2) and stats.alpha == 1.0


def test_a_position_the_processors_leave_without_a_token_is_verified_no_further():
    """HF's processors (no_repeat_ngram_size over a vocabulary suppress_tokens restricts) can leave no admissible
    token at a block position j >= 1, whose context holds j drafts model.generate may never build (a draft the
    verification rejects; in a batch, a row past its own end). The row verifies j drafts there, as where a
    processor raises; it failed ("has NaN, +inf or an all -inf row") where model.generate completes."""
    from helpers.models import llama

    target, draft = llama(), llama(layers=1, seed=2)

    def restricted(allowed, new):
        return dict(max_new_tokens=new, no_repeat_ngram_size=2, eos_token_id=None,
                    suppress_tokens=[t for t in range(97) if t not in allowed])

    prompt = torch.tensor([[92, 92, 92, 92, 92, 15, 15, 15]])
    settings = restricted([15, 21, 92], 6)
    want = target.generate(prompt, do_sample=False, pad_token_id=0, **settings)
    got = sk.generate(target, prompt, prompt_lookup_num_tokens=3, do_sample=False, pad_token_id=0, **settings)
    assert torch.equal(got, want)
    prompt = [96, 96, 25, 25]
    settings = restricted([71, 96, 25], 4)
    want = target.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **settings)[0, 4:].tolist()
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    decoder.add_request([9, 10, 11, 12], max_new_tokens=40, do_sample=False)
    request = decoder.add_request(prompt, do_sample=False, **settings)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(request).token_ids == want


def test_a_position_the_processors_turn_nan_or_inf_is_verified_no_further():
    """A processor can put +inf or NaN at a block position j >= 1 only because of the drafts in its context: here a
    sequence bias of +inf on (a, 11) after a token ``a`` that suppress_tokens bans, which the draft (unprocessed)
    proposes; model.generate never emits ``a``, so it never builds that context (transformers 5.17's
    exponential_decay_length_penalty makes NaN so, from a forced EOS's -inf on the other EOS ids: fuzz draw 21824
    of test_differential_broad). The row verifies j drafts there, as where no token is admissible; it failed ("has
    NaN, +inf or an all -inf row") where model.generate completes. At position 0 (the real context) it still fails."""
    target = llama()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    a = int(hf_generate(target, ids, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])
    kwargs = dict(max_new_tokens=6, do_sample=False, suppress_tokens=[a])
    for bias in (float("nan"), float("inf")):
        settings = dict(kwargs, sequence_bias={(a, 11): bias})
        want = hf_generate(target, ids, pad_token_id=0, **settings)
        got = _quiet(sk.generate, target, ids, draft_model=target, num_speculative_tokens=3, pad_token_id=0,
                     **settings)
        assert torch.equal(got, want), bias
    decoder = sk.SpeculativeDecoder(target, target, num_speculative_tokens=3)  # (a batch of requests: per row)
    request = decoder.add_request(ids[0].tolist(), **settings)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(request).token_ids == want[0, ids.shape[1]:].tolist()
    with pytest.raises(ValueError, match="target_logits"):  # (+inf at the real context: refused, README)
        _quiet(sk.generate, target, ids, draft_model=target, num_speculative_tokens=3, pad_token_id=0,
               **dict(kwargs, suppress_tokens=[], sequence_bias={(9, a): float("inf")}))


def test_each_processor_class_is_inspected_once_not_each_rows_processor(monkeypatch):
    """A call's rows each hold their own processors: whether one needs more arguments than (input_ids, scores) is
    its class's answer, worked out once (inspecting every row's took ~0.27 s at 1000 rows); a processor of the
    caller's own that needs more is still refused by name."""
    import inspect

    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    from speculative_kernels.generation import context_processors

    calls = []
    signature = inspect.signature
    monkeypatch.setattr(context_processors.inspect, "signature", lambda f: calls.append(f) or signature(f))
    lists = [[RepetitionPenaltyLogitsProcessor(1.2), NoRepeatNGramLogitsProcessor(3)] for _ in range(50)]
    context_processors.RowProcessors(lists)
    assert len(calls) <= 4

    class NeedsMore(LogitsProcessor):
        def __call__(self, input_ids, scores, extra):
            return scores

    with pytest.raises(ValueError, match="NeedsMore takes more arguments"):
        context_processors.RowProcessors([[NeedsMore()], [NeedsMore()]])
