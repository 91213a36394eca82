"""Per-request logits processors and sampling warpers in continuous batching (``add_request(repetition_penalty=...,
no_repeat_ngram_size=..., min_p=...)``, or the model's generation_config defaults): each request's output is its
output alone, whatever joins or leaves around it: greedy token-identical to ``model.generate``, seeded sampling to
``speculative_kernels.generate`` with the same seed."""

import copy

import pytest
import torch

import speculative_kernels as sk
from speculative_kernels import CompileOptions
from helpers.continuous import alone, run_arrivals
from helpers.models import llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GAMMA = 3


@pytest.fixture(scope="module")
def pair():
    return llama().to(DEVICE), llama(layers=1, seed=2).to(DEVICE)


def _alone(target, draft, prompt, settings):
    return alone(target, draft, prompt, settings, GAMMA, DEVICE)


ARRIVALS = {
    0: [([5, 6, 7, 8], dict(max_new_tokens=14, do_sample=False, repetition_penalty=1.4)),
        ([9, 10], dict(max_new_tokens=12, do_sample=False)),
        # still running when longer prompts join (its own tokens move right in the batch at each merge)
        ([50, 51], dict(max_new_tokens=16, do_sample=False, exponential_decay_length_penalty=(4, 1.6),
                        eos_token_id=2))],
    2: [([11, 12, 13, 14, 15, 16], dict(max_new_tokens=10, do_sample=False, no_repeat_ngram_size=2,
                                        bad_words_ids=[[56]])),
        ([17], dict(max_new_tokens=9, do_sample=True, temperature=0.9, min_p=0.05, repetition_penalty=1.2, seed=4))],
    4: [([20, 21, 22], dict(max_new_tokens=10, do_sample=True, typical_p=0.8, seed=5)),
        ([23, 24, 25, 26, 27, 28, 29, 30], dict(max_new_tokens=8, do_sample=False, suppress_tokens=[62, 83],
                                                 min_new_tokens=3)),
        # left-padded by 6 among the joining rows: its processor must read its own length, not the batch's
        ([40, 41], dict(max_new_tokens=14, do_sample=False, exponential_decay_length_penalty=(1, 2.0),
                        eos_token_id=2))],
}


@pytest.mark.parametrize("way", ["dynamic", "static", "compiled"])
def test_each_request_with_its_processors_matches_it_alone(pair, way):
    target, draft = pair
    options = {"dynamic": {}, "static": dict(cache_implementation="static", max_context=64),
               "compiled": dict(cache_implementation="static", max_context=64,
                                compile=CompileOptions(backend="eager"))}[way]
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, **options)
    requests, streamed = run_arrivals(decoder, ARRIVALS)
    changed = 0
    for request_id, (prompt, settings) in requests.items():
        expected = _alone(target, draft, prompt, settings)
        assert decoder.result(request_id).token_ids == expected == streamed[request_id], (prompt, settings)
        plain = {k: v for k, v in settings.items() if k in ("max_new_tokens", "do_sample", "temperature", "seed")}
        changed += expected != _alone(target, draft, prompt, plain)
    assert changed >= 3  # the processors change outputs: the comparisons can fail


def test_the_models_generation_config_defaults_apply_per_request(pair):
    """A checkpoint whose generation_config sets repetition_penalty (Qwen2.5 instruct: 1.05) can be served."""
    target, draft = pair
    model = copy.deepcopy(target)
    model.generation_config.repetition_penalty = 1.4
    decoder = sk.SpeculativeDecoder(model, draft, num_speculative_tokens=GAMMA)
    arrivals = {0: [([5, 6, 7, 8], dict(max_new_tokens=12))],
                2: [([9, 10, 11], dict(max_new_tokens=10)), ([12, 13], dict(max_new_tokens=9, repetition_penalty=1.0))]}
    requests, _ = run_arrivals(decoder, arrivals)
    for request_id, (prompt, settings) in requests.items():
        assert decoder.result(request_id).token_ids == _alone(model, draft, prompt, settings)
    assert any(decoder.result(r).token_ids != _alone(target, draft, prompt, settings)  # the default changed one
               for r, (prompt, settings) in requests.items() if "repetition_penalty" not in settings)


def test_settings_that_only_change_scores_or_are_invalid_are_refused(pair):
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft)
    with pytest.raises(ValueError, match="renormalize_logits"):
        model = copy.deepcopy(target)
        model.generation_config.renormalize_logits = True
        sk.SpeculativeDecoder(model, draft).add_request([5, 6], max_new_tokens=3)
    with pytest.raises(ValueError, match="penalty"):
        decoder.add_request([5, 6], max_new_tokens=3, repetition_penalty=-1.0)
    with pytest.raises(ValueError, match="logits_processor is not a keyword add_request takes"):
        decoder.add_request([5, 6], max_new_tokens=3, logits_processor=[])
    with pytest.raises(ValueError, match="watermarking_config .*not supported by add_request"):
        model = copy.deepcopy(target)
        model.generation_config.watermarking_config = __import__("transformers").WatermarkingConfig()
        sk.SpeculativeDecoder(model, draft).add_request([5, 6], max_new_tokens=3)


@pytest.mark.parametrize("settings", [dict(bad_words_ids=[[3, 500]]), dict(sequence_bias={(500,): 2.0})])
def test_ids_past_the_vocabulary_in_a_processors_settings_are_refused_by_add_request(pair, settings):
    """HF's bad-words and sequence-bias processors check their ids against the logits' width at their first call
    (model.generate raises then). add_request accepted such a request; the step admitting it raised, and so did every
    later step (the request stayed queued): the running request never advanced. add_request now refuses it, naming
    the processor, and the batch goes on."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    running = decoder.add_request([5, 6, 7], max_new_tokens=6, do_sample=False)
    decoder.step()
    with pytest.raises(ValueError, match="(NoBadWords|SequenceBias)LogitsProcessor.*tokens were being biased: .500"):
        decoder.add_request([9, 10], max_new_tokens=4, do_sample=False, **settings)
    assert decoder.queued == []
    while decoder.has_work():
        decoder.step()
    assert decoder.result(running).token_ids == _alone(target, draft, [5, 6, 7], dict(max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("processor", [dict(repetition_penalty=1.0001), dict(no_repeat_ngram_size=5)])
def test_a_sampled_request_with_min_new_tokens_and_processors_matches_generate_alone(pair, processor):
    # The draft's EOS is masked before min_new_tokens whatever else the request sets, as in generate: with the
    # mask dropped for requests with processors, q differed, and with it the seeded tokens (distribution still exact).
    target, draft = pair
    for seed in range(6):
        settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=True, top_p=0.5, top_k=0, seed=seed, **processor)
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
        request_id = decoder.add_request([48, 7, 30], **settings)
        while decoder.has_work():
            decoder.step()
        assert decoder.result(request_id).token_ids == _alone(target, draft, [48, 7, 30], settings), seed
