"""The contract of issue 11: HF's defaults, nothing silently ignored, a non-finite value never becomes a token.

One test per reproduction of the issue, and a table of bad inputs across the public surface (``generate``, the
ops, ``SpeculativeDecoder``, the CLI): each row names the input, the error class and the words the error must say.
"""

import warnings

import pytest
import torch
from transformers import GenerationConfig

import speculative_kernels as sk
from helpers.models import hf_generate, llama
from speculative_kernels import ops
from speculative_kernels.cli import main
from speculative_kernels.generation import buffers
from speculative_kernels.generation import settings

P = torch.tensor([[1, 17, 42, 70, 7]])


@pytest.fixture(scope="module")
def pair():
    return llama(), llama(layers=1, seed=3)


# ---- 1. a non-finite value after temperature scaling is never a token --------------------------------------------
def test_tiny_temperature_is_refused_not_token_zero(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="temperature=1e-40 is below float32's smallest normal"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=6, do_sample=True, temperature=1e-40)


def test_target_logits_that_overflow_when_scaled_raise(pair):
    """A target whose logits are finite but overflow float32 at temperature 0.5 (a row of 3e38 logits)."""
    target, draft = pair
    huge = llama()
    with torch.no_grad():
        huge.lm_head.weight.zero_()
        huge.lm_head.bias = None
        huge.lm_head.weight[5] = 1e30  # logit of token 5 ~ 1e30 * sum(hidden): finite, but / 0.5 overflows or not
    ids = P.clone()
    with torch.no_grad():
        logits = huge(ids).logits[0, -1]
        assert torch.isfinite(logits).all()
        huge.lm_head.weight[5] *= 3e38 / float(logits.abs().max())  # largest logit ~3e38: finite, 6e38 scaled
        assert torch.isfinite(huge(ids).logits).all()
    with pytest.raises(ValueError, match="divided by temperature=0.5 is not finite"):
        sk.generate(huge, ids, draft_model=draft, max_new_tokens=4, do_sample=True, temperature=0.5)


# ---- 2. the default length is HF's ---------------------------------------------------------------------------------
def test_default_length_matches_model_generate(pair):
    target, draft = pair
    for ids in (P, torch.randint(3, 97, (1, 25), generator=torch.Generator().manual_seed(0))):
        expected = hf_generate(target, ids)
        with pytest.warns(UserWarning, match="model-agnostic default `max_length`"):
            got = sk.generate(target, ids, draft_model=draft)
        assert torch.equal(got, expected) and got.shape[1] == ids.shape[1] + 20


def test_default_length_is_capped_by_the_context_likehf_generate():
    target, draft = llama(), llama(layers=1, seed=3)
    for model in (target, draft):
        model.config.max_position_embeddings = 30
    ids = torch.randint(3, 97, (1, 25), generator=torch.Generator().manual_seed(1))
    expected = hf_generate(target, ids)
    with pytest.warns(UserWarning):
        got = sk.generate(target, ids, draft_model=draft)
    assert torch.equal(got, expected) and got.shape[1] == 30


def test_explicit_max_length_counts_the_prompt_likehf_generate(pair):
    target, draft = pair
    assert torch.equal(sk.generate(target, P, draft_model=draft, max_length=12), hf_generate(target, P, max_length=12))
    with pytest.raises(ValueError, match="Input length of input_ids is 5, but `max_length` is set to 5"):
        sk.generate(target, P, draft_model=draft, max_length=5)
    target.generation_config.max_length = 9  # a checkpoint's own max_length is a total length, as in HF
    try:
        assert torch.equal(sk.generate(target, P, draft_model=draft), hf_generate(target, P))
        assert sk.generate(target, P, draft_model=draft).shape[1] == 9
    finally:
        target.generation_config.max_length = None


# ---- 3. every GenerationConfig field is honoured or refused by name ----------------------------------------------
def test_every_generation_config_field_is_classified():
    """A field of the installed transformers that none of the tables names fails here (classify it in
    settings.py: honoured, no effect, or refused); stale names fail too."""
    fields = set(GenerationConfig().to_dict())
    assert fields == settings.generation_fields()
    tables = [set(settings.HONOURED), set(settings.NO_EFFECT), set(settings.REFUSED_UNLESS)]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])
    assert fields - settings.classified_fields() == set(), "unclassified GenerationConfig fields"
    assert settings.classified_fields() - fields == set(), "names in the tables that GenerationConfig lacks"


def test_an_unclassified_field_is_refused_at_run_time(pair, monkeypatch):
    """What a newer transformers adds is refused by name when set, until settings.py classifies it."""
    target, draft = pair
    monkeypatch.delitem(settings.REFUSED_UNLESS, "token_healing")
    with pytest.raises(ValueError, match="token_healing=True is a generation setting speculative_kernels does not"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=3, token_healing=True)


# A value that is not "off" for every refused field (a new refused field needs one here).
REFUSED_SAMPLES = {
    "num_beams": 2,
    "force_words_ids": [[5]], "constraints": ["x"], "penalty_alpha": 0.6, "guidance_scale": 1.5,
    "output_attentions": True,
    "output_hidden_states": True, "token_healing": True,
    "dola_layers": "high", "use_mtp": True, "assistant_confidence_threshold": 0.2,
    "is_assistant": True,
    "assistant_ensemble_weight": 0.5,
    "cache_config": {"backend": "quanto"}, "max_cache_len": 64, "compile_config": {"fullgraph": True},
    "continuous_batching_config": {"x": 1}, "speculation_type": "dflash",
}


def test_refused_samples_cover_the_table():
    assert set(REFUSED_SAMPLES) == set(settings.REFUSED_UNLESS)


@pytest.mark.parametrize("name", sorted(settings.REFUSED_UNLESS))
def test_each_refused_field_raises_naming_it(pair, name):
    target, draft = pair
    with pytest.raises(ValueError, match=name):  # our message, or HF's own check where it comes first
        sk.generate(target, P, draft_model=draft, max_new_tokens=3, **{name: REFUSED_SAMPLES[name]})


@pytest.mark.parametrize("name", ["num_assistant_tokens_schedule", "cache_implementation", "use_cache",
                                  "assistant_lookbehind", "target_lookbehind"])
def test_honoured_fields_refuse_what_they_cannot_do(pair, name):
    target, draft = pair
    # (the lookbehinds: a draft with another tokenizer's; with this pair's one vocabulary they would do nothing)
    value = {"num_assistant_tokens_schedule": "heuristic", "cache_implementation": "offloaded",
             "use_cache": False, "assistant_lookbehind": 5, "target_lookbehind": 5}[name]
    with pytest.raises(ValueError, match=name):
        sk.generate(target, P, draft_model=draft, max_new_tokens=3, **{name: value})


@pytest.mark.parametrize("schedule", ["heuristic", "heuristic_transient"])
def test_a_draft_whose_config_schedules_gamma_is_refused_unless_gamma_is_given(schedule):
    """HF's assisted generation reads the draft length and its schedule from the draft's generation_config, and a
    "heuristic" one there changes it while decoding ("heuristic" also writes the last value back to the draft's
    config, which the next call's gamma here followed: seeded tokens depended on an unrelated earlier
    model.generate). Gamma is constant here: the schedule was ignored silently; with no num_speculative_tokens it
    is refused by name, and a given gamma decides."""
    target, draft = llama(), llama(layers=1, seed=2)
    draft.generation_config.num_assistant_tokens_schedule = schedule
    with pytest.raises(ValueError, match=f"draft model's generation_config.num_assistant_tokens_schedule='{schedule}'"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=3)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        sk.SpeculativeDecoder(target, draft).add_request(P[0].tolist(), max_new_tokens=3)
    got = sk.generate(target, P, draft_model=draft, max_new_tokens=6, num_speculative_tokens=3)
    assert torch.equal(got, hf_generate(target, P, max_new_tokens=6))


def test_num_assistant_tokens_is_gamma(pair):
    target, draft = pair
    expected = hf_generate(target, P, max_new_tokens=12)
    for source in ("kwarg", "generation_config", "draft_config"):
        stats = sk.SpeculationStats()
        if source == "kwarg":
            got = sk.generate(target, P, draft_model=draft, max_new_tokens=12, num_assistant_tokens=3,
                              speculation_stats=stats)
        elif source == "generation_config":
            got = sk.generate(target, P, draft_model=draft, speculation_stats=stats,
                              generation_config=GenerationConfig(max_new_tokens=12, num_assistant_tokens=3))
        else:
            draft.generation_config.num_assistant_tokens = 3  # where HF's assisted generation reads it
            try:
                got = sk.generate(target, P, draft_model=draft, max_new_tokens=12, speculation_stats=stats)
            finally:
                draft.generation_config.num_assistant_tokens = None
        assert torch.equal(got, expected)
        assert stats.num_speculative_tokens == 3 and len(stats.accepted_histogram) == 4, source
    stats = sk.SpeculationStats()
    sk.generate(target, P, draft_model=draft, max_new_tokens=12, speculation_stats=stats)
    assert stats.num_speculative_tokens == settings.DEFAULT_NUM_SPECULATIVE_TOKENS  # not HF's 20
    with pytest.raises(ValueError, match="num_speculative_tokens=4 and num_assistant_tokens=3 disagree"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=4, num_speculative_tokens=4,
                    num_assistant_tokens=3)
    # A checkpoint's num_assistant_tokens (target's or draft's generation_config) is a default: the call's
    # num_speculative_tokens wins, as any argument wins over a generation_config default (it raised "disagree").
    for model in (target, draft):
        model.generation_config.num_assistant_tokens = 10
        try:
            stats = sk.SpeculationStats()
            got = sk.generate(target, P, draft_model=draft, max_new_tokens=12, num_speculative_tokens=3,
                              speculation_stats=stats)
        finally:
            model.generation_config.num_assistant_tokens = None
        assert torch.equal(got, expected) and stats.num_speculative_tokens == 3


def test_no_effect_fields_change_nothing(pair):
    """Beam-search-only settings, which model.generate itself ignores when greedy or sampling (checked here)."""
    target, draft = pair
    no_effect = dict(early_stopping=True, length_penalty=2.0, disable_compile=True, num_beam_groups=2,
                     diversity_penalty=0.5, low_memory=True)
    expected = sk.generate(target, P, draft_model=draft, max_new_tokens=8)
    assert torch.equal(sk.generate(target, P, draft_model=draft, max_new_tokens=8, **no_effect), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(target.generate(P, max_new_tokens=8, **no_effect), expected)


# ---- 4. token ids and lengths of odd types -------------------------------------------------------------------------
def test_eos_token_id_types_ashf_generate(pair):
    target, draft = pair
    first = int(hf_generate(target, P, max_new_tokens=1)[0, -1])
    for eos in (first, float(first), [float(first)], torch.tensor([first])):
        got = sk.generate(target, P, draft_model=draft, max_new_tokens=5, eos_token_id=eos)
        assert torch.equal(got, hf_generate(target, P, max_new_tokens=5, eos_token_id=first)) and got.shape[1] == 6, eos
    with pytest.raises(TypeError, match="eos_token_id must be a token id"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=5, eos_token_id=str(first))
    with pytest.raises(TypeError, match="eos_token_id must be a token id"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=5, eos_token_id=65.5)


def test_fractional_max_new_tokens_ashf_generate(pair):
    target, draft = pair
    expected = hf_generate(target, P, max_new_tokens=5.5)
    got = sk.generate(target, P, draft_model=draft, max_new_tokens=5.5)
    assert torch.equal(got, expected) and got.shape[1] == 5 + 6
    with pytest.raises(TypeError, match="max_new_tokens must be an int, got str"):
        sk.generate(target, P, draft_model=draft, max_new_tokens="5")


def test_tensor_lengths_ashf_generate(pair):
    """A length computed with torch (``lengths.max()``, a 0-d tensor) is taken as model.generate takes it; it was
    refused with a TypeError."""
    target, draft = pair
    for kwargs in (dict(max_new_tokens=torch.tensor(6)), dict(max_new_tokens=torch.tensor(5.5)),
                   dict(max_length=torch.tensor(9))):
        expected = hf_generate(target, P, **kwargs)
        assert torch.equal(sk.generate(target, P, draft_model=draft, **kwargs), expected), kwargs
    with pytest.raises(TypeError, match="max_new_tokens must be an int, got Tensor"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=torch.tensor([6, 7]))


# ---- 6. session statistics ----------------------------------------------------------------------------------------
def test_session_stats_report_phase_times(pair):
    target, draft = pair
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(P, max_new_tokens=8)
    while not session.finished:
        session.step()
    stats = session.stats
    assert stats.draft_time_s > 0 and stats.verify_time_s > 0
    assert stats.total_time_s >= stats.draft_time_s + stats.verify_time_s


# ---- buffers sized by what is generated; gamma capped by what is left -------------------------------------------
def test_huge_max_new_tokens_allocates_nothing_up_front(pair):
    target, draft = pair
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=4).start(P, max_new_tokens=10**9)
    loop = session.loop
    assert loop.sequences.shape[1] < 300 and loop.target_runner.slot_mask.shape[1] < 400
    for _ in range(3):
        session.step()


def test_buffers_grow_and_output_is_unchanged(pair, monkeypatch):
    """Tiny initial buffers force many doublings (sequences, scores, slot masks), with rows leaving the batch."""
    target, draft = pair
    monkeypatch.setattr(buffers, "INITIAL_NEW_TOKENS", 2)
    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True, eos_token_id=[2, 11, 30])
    expected = hf_generate(target, ids, **kwargs)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)


def test_gamma_is_capped_by_the_tokens_left(pair):
    target, draft = pair
    stats = sk.SpeculationStats()
    got = sk.generate(target, P, draft_model=draft, num_speculative_tokens=1000, max_new_tokens=6,
                      speculation_stats=stats)
    assert torch.equal(got, hf_generate(target, P, max_new_tokens=6))
    assert stats.draft_forwards <= 5 + 4 + 3 + 2 + 1  # each iteration drafts at most the tokens left, less one
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=1000).start(P, max_new_tokens=6)
    while not session.finished:
        left = 6 - int(session.loop.generated[0])
        session.step()
        assert session.loop.gamma == left - 1
    stats = sk.SpeculationStats()
    got = sk.generate(target, P, draft_model=draft, max_new_tokens=1, speculation_stats=stats)
    assert torch.equal(got, hf_generate(target, P, max_new_tokens=1))
    assert (stats.draft_forwards, stats.target_forwards) == (0, 1)  # one token left: no drafting
    torch.manual_seed(0)
    sampled = sk.generate(target, P, draft_model=draft, max_new_tokens=1, do_sample=True, temperature=0.8)
    assert sampled.shape[1] == 6


# ---- bad inputs across the public surface --------------------------------------------------------------------------
class _NoPut:
    def end(self):
        pass


def _zero_row_mask():
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[1] = 0
    return mask


GENERATE_ROWS = [
    # (what, kwargs (input_ids overrides P), error, words)
    ("list input_ids", dict(input_ids=[[1, 2, 3]]), TypeError, "input_ids must be a torch.Tensor"),
    ("dict generation_config", dict(generation_config={"max_new_tokens": 3}), TypeError,
     "generation_config must be a transformers.GenerationConfig, got dict"),
    ("list attention_mask", dict(attention_mask=[[1, 1, 1, 1, 1]]), TypeError, "attention_mask must be a torch.Tensor"),
    ("all-zero mask row", dict(input_ids=torch.cat([P, P]), attention_mask=_zero_row_mask(), pad_token_id=0),
     ValueError, "attention_mask is all zeros in batch rows \\[1\\]"),
    ("float mask with 0.5", dict(attention_mask=torch.tensor([[1.0, 0.5, 1.0, 1.0, 1.0]])), ValueError,
     "attention_mask must hold only 0 and 1, got 0.5"),
    ("mask with -1", dict(attention_mask=torch.tensor([[1, -1, 1, 1, 1]])), ValueError,
     "attention_mask must hold only 0 and 1, got -1"),
    ("mask with 2", dict(attention_mask=torch.tensor([[1, 1, 2, 1, 1]], dtype=torch.int32)), ValueError,
     "attention_mask must hold only 0 and 1, got 2"),
    ("complex mask", dict(attention_mask=torch.ones(1, 5, dtype=torch.complex64)), TypeError,
     "attention_mask must be a bool, integer or floating-point tensor"),
    ("tokenizer='x'", dict(tokenizer="x"), TypeError, "tokenizer must be a transformers tokenizer"),
    ("batching='x'", dict(batching="x"), TypeError, "batching must be a speculative_kernels BatchingOptions"),
    ("streamer without put", dict(streamer=_NoPut()), TypeError, "streamer must have put\\(\\) and end\\(\\)"),
    ("stopping_criteria=[1]", dict(stopping_criteria=[1]), TypeError, "stopping_criteria must hold callables"),
    ("max_new_tokens='5'", dict(max_new_tokens="5"), TypeError, "max_new_tokens must be an int, got str"),
    ("max_new_tokens=-1", dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0"),
    ("min_new_tokens=2.5", dict(min_new_tokens=2.5), TypeError, "min_new_tokens must be an int"),
    ("prompt id outside vocabulary", dict(input_ids=torch.tensor([[1, 500, 3]])), ValueError,
     "input_ids holds id 500, outside the vocabulary \\[0, 97\\)"),
    ("prompt id = vocabulary size", dict(input_ids=torch.tensor([[1, 97, 3]])), ValueError,
     "input_ids holds id 97, outside the vocabulary \\[0, 97\\)"),
    ("eos_token_id='65'", dict(eos_token_id="65"), TypeError, "eos_token_id must be a token id"),
    ("pad_token_id='x'", dict(pad_token_id="x"), TypeError, "pad_token_id must be a token id"),
    ("temperature=1e-40", dict(do_sample=True, temperature=1e-40), ValueError, "temperature=1e-40"),
    # (accepted: HF's TemperatureLogitsWarper refuses a temperature that is not a float; 1 builds no warper)
    ("temperature=2 (an int)", dict(do_sample=True, temperature=2), ValueError,
     "temperature must be a float when do_sample=True"),
    ("temperature as a tensor", dict(do_sample=True, temperature=torch.tensor(0.5)), ValueError,
     "temperature must be a float when do_sample=True"),
    ("num_speculative_tokens=0", dict(num_speculative_tokens=0), ValueError, "num_speculative_tokens must be >= 1"),
    ("num_assistant_tokens=0", dict(num_assistant_tokens=0), ValueError, "num_assistant_tokens must be >= 1"),
    ("prompt_lookup_num_tokens with a draft", dict(prompt_lookup_num_tokens=3), ValueError,
     "pass either draft_model \\(or assistant_model\\) / drafter= or prompt_lookup_num_tokens, not both"),
    ("max_new_tokens=inf", dict(max_new_tokens=float("inf")), ValueError, "max_new_tokens must be finite"),
    # a batch of no prompts generated a row from BOS (input_ids) / failed on max() of nothing (mask alone)
    ("input_ids with no rows", dict(input_ids=torch.zeros(0, 5, dtype=torch.int64),
                                    attention_mask=torch.zeros(0, 5, dtype=torch.int64)), ValueError,
     "input_ids has no rows"),
    ("attention_mask with no rows, no input_ids", dict(input_ids=None, attention_mask=torch.zeros(0, 1)), ValueError,
     "attention_mask without input_ids must be \\[batch, 1\\] ones"),
]


@pytest.mark.parametrize("what,kwargs,error,words", GENERATE_ROWS, ids=[r[0] for r in GENERATE_ROWS])
def test_bad_generate_inputs(pair, what, kwargs, error, words):
    target, draft = pair
    kwargs = {"input_ids": P, "max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=words):
        sk.generate(target, kwargs.pop("input_ids"), draft_model=draft, **kwargs)


DECODER_ROWS = [r for r in GENERATE_ROWS if "batching" not in r[1]]  # SpeculativeDecoder takes no batching


@pytest.mark.parametrize("what,kwargs,error,words", DECODER_ROWS, ids=[r[0] for r in DECODER_ROWS])
def test_bad_decoder_inputs(pair, what, kwargs, error, words):
    """The same inputs through SpeculativeDecoder.start (streamer is refused there for its own reason)."""
    target, draft = pair
    kwargs = {"input_ids": P, "max_new_tokens": 3, **kwargs}
    helpers = {k: kwargs.pop(k) for k in ("tokenizer", "num_speculative_tokens") if k in kwargs}
    if "streamer" in kwargs:
        error, words = ValueError, "streamer is not available on a session"
    with pytest.raises(error, match=words):  # (a bad tokenizer: by the constructor, which checks the pair)
        sk.SpeculativeDecoder(target, draft, **helpers).start(kwargs.pop("input_ids"), **kwargs)


def _logits(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


OPS_ROWS = [
    ("B=0 verify", lambda: ops.verify(_logits(0, 3, 8), None, torch.zeros(0, 2, dtype=torch.int64)), ValueError,
     "target_logits has an empty batch"),
    ("B=0 sample", lambda: ops.sample(_logits(0, 8)), ValueError, "logits has an empty batch"),
    ("offset tensor 2**32", lambda: ops.sample(_logits(2, 8), seed=0, offset=torch.tensor(2**32)), ValueError,
     "offset must be in \\[0, 2\\*\\*32\\)"),
    ("seed tensor -1", lambda: ops.sample(_logits(2, 8), seed=torch.tensor(-1)), ValueError,
     "seed must be in \\[0, 2\\*\\*63\\)"),
    ("seed float", lambda: ops.sample(_logits(2, 8), seed=1.5), TypeError, "seed must be an int"),
    ("temperature 1e-40", lambda: ops.sample(_logits(2, 8), temperature=1e-40, seed=0), ValueError,
     "temperature=1e-40"),
    ("logit 3e38 at T 0.5", lambda: ops.verify(_logits(1, 2, 8).index_fill_(2, torch.tensor([3]), 3e38), None,
                                                torch.zeros(1, 1, dtype=torch.int64), temperature=0.5, seed=0),
     ValueError, "target_logits divided by temperature=0.5 is not finite"),
    ("list logits", lambda: ops.sample([[0.0, 1.0]]), TypeError, "logits must be a torch.Tensor"),
    ("top_k float", lambda: ops.sample(_logits(2, 8), top_k=2.0, seed=0), TypeError, "top_k must be an int"),
]


@pytest.mark.parametrize("what,call,error,words", OPS_ROWS, ids=[r[0] for r in OPS_ROWS])
def test_bad_op_inputs(what, call, error, words):
    with pytest.raises(error, match=words):
        call()


CLI_ROWS = [
    ("--device tpu", ["--device", "tpu"], "--device 'tpu' is not a device name"),
    ("--device cuda without CUDA", ["--device", "cuda"], "CUDA is not available"),
    ("--backend cuda on cpu", ["--device", "cpu", "--backend", "cuda"], "--backend cuda: backend 'cuda' cannot run"),
    ("--top-k when greedy", ["--top-k", "5"], "--top-k/--top-p/--min-p only apply when sampling"),
    ("--top-p when greedy", ["--top-p", "0.5"], "--top-k/--top-p/--min-p only apply when sampling"),
    ("--min-p when greedy", ["--min-p", "0.1"], "--top-k/--top-p/--min-p only apply when sampling"),
    ("--min-p above 1 when sampling", ["--temperature", "0.7", "--min-p", "1.5"], "--min-p must be in"),
    ("--max-new-tokens beyond the context", ["--max-new-tokens", "1000000000"],
     "exceeds the target's context length"),
    ("--top-p 0 when sampling", ["--temperature", "0.7", "--top-p", "0"], "top_p must be in"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA rows assume a machine without CUDA")
@pytest.mark.parametrize("what,argv,words", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_bad_cli_inputs(cli_pair, capsys, what, argv, words):
    target, draft = cli_pair
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def f(x):",
                 "--max-new-tokens", "4", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, no traceback
    assert pytest.importorskip("re").search(words, err), err


@pytest.fixture(scope="module")
def cli_pair(tmp_path_factory):
    from helpers.checkpoints import save_decoder_pair

    return save_decoder_pair(tmp_path_factory.mktemp("contract_pair"))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_default_length_matches_model_generate_encoder_decoder(family):
    """The same rule over the decoder sequence: 20 new decoder tokens (it was 19)."""
    from helpers import seq2seq_models

    make = getattr(seq2seq_models, family)
    target, draft = make(), make(layers=1, seed=5)
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(3))
    target.generation_config.eos_token_id = draft.generation_config.eos_token_id = None  # run to the limit
    expected = hf_generate(target, ids)
    with pytest.warns(UserWarning, match="model-agnostic default"):
        got = sk.generate(target, ids, draft_model=draft)
    assert torch.equal(got, expected) and got.shape[1] == 21


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_attention_masks_as_model_generate(dtype):
    """``torch.ones`` makes float32 masks, which model.generate takes: 0/1 float masks give its tokens (decoder-only
    left-padded batch, the encoder mask of a seq2seq model, and a decoder session), not a TypeError."""
    from helpers.seq2seq_models import source_batch, t5

    target, draft = llama(), llama(layers=1, seed=2)
    ids = torch.tensor([[0, 0, 5, 9, 14], [3, 22, 41, 7, 8]])
    mask = (ids != 0).to(dtype)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = target.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(expected, target.generate(ids, attention_mask=mask.long(), **kwargs))
    assert torch.equal(sk.generate(target, ids, attention_mask=mask, draft_model=draft, **kwargs), expected)
    session = sk.SpeculativeDecoder(target, draft).start(ids, attention_mask=mask, **kwargs)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), expected)
    source, source_mask = source_batch([6, 4])
    target, draft = t5(), t5(layers=1, seed=3)
    expected = target.generate(source, attention_mask=source_mask.to(dtype), max_new_tokens=6, do_sample=False)
    got = sk.generate(target, source, attention_mask=source_mask.to(dtype), draft_model=draft, max_new_tokens=6,
                      do_sample=False)
    assert torch.equal(got, expected)


def test_a_mask_value_other_than_0_or_1_is_refused_where_model_generate_differs():
    """model.generate on GPT-2 with a -1 in the mask gives other tokens than with 1 (its position ids count the
    mask's values); ours read it as != 0, silently other tokens than HF's. Now refused by name."""
    from helpers.models import gpt2

    target, draft = gpt2(), gpt2(layers=1, seed=2)
    ids = torch.tensor([[0, 0, 5, 9, 14], [3, 22, 41, 7, 8]])
    mask = (ids != 0).long()
    odd = mask.clone()
    odd[1, 2] = -1
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert not torch.equal(target.generate(ids, attention_mask=odd, **kwargs),
                           target.generate(ids, attention_mask=mask, **kwargs))
    with pytest.raises(ValueError, match="attention_mask must hold only 0 and 1, got -1"):
        sk.generate(target, ids, attention_mask=odd, draft_model=draft, **kwargs)


# ---- HF's "off" values, accepted as HF accepts them -----------------------------------------------------------------
def test_temperature_none_samples_at_temperature_one(pair):
    """HF applies no temperature warper for temperature=None (a script passing an unset args.temperature): sampling
    at 1.0. Ours refused it with a TypeError; it now draws the very tokens temperature=1.0 draws, in generate and
    add_request."""
    target, draft = pair
    kwargs = dict(draft_model=draft, max_new_tokens=10, do_sample=True, top_k=0, seed=3)
    assert torch.equal(sk.generate(target, P, temperature=None, **kwargs),
                       sk.generate(target, P, temperature=1.0, **kwargs))
    results = []
    for temperature in (None, 1.0):
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
        request = decoder.add_request(P[0], max_new_tokens=10, do_sample=True, top_k=0, temperature=temperature, seed=3)
        while decoder.result(request).finish_reason is None:
            decoder.step()
        results.append(decoder.result(request).token_ids)
    assert results[0] == results[1]


def test_synced_gpus_false_and_trust_remote_code_are_taken_as_hf_takes_them(pair):
    """synced_gpus=False (a single process, HF's default) was refused like True; trust_remote_code, which HF's
    generate reads only to load a custom_generate, was refused as an unknown keyword."""
    target, draft = pair
    expected = hf_generate(target, P, max_new_tokens=8)
    for extra in ({"synced_gpus": False}, {"trust_remote_code": True}, {"trust_remote_code": False}):
        assert torch.equal(sk.generate(target, P, draft_model=draft, max_new_tokens=8, do_sample=False, **extra),
                           expected)
    with pytest.raises(ValueError, match="synced_gpus is not supported"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=8, synced_gpus=True)
    with pytest.raises(TypeError, match="trust_remote_code must be a bool"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=8, trust_remote_code="yes")


def test_add_request_takes_a_checkpoints_cache_implementation_that_is_the_decoders(pair):
    """A checkpoint's cache_implementation='dynamic' (HF's default) or 'static' on a static decoder asks for the cache
    the decoder already uses: add_request refused both. Another one is still refused, naming the decoder's."""
    target, draft = pair
    target = llama()  # (its own generation_config, changed below)
    expected = hf_generate(target, P, max_new_tokens=8)[0, P.shape[1]:].tolist()
    for implementation, decoder_kwargs in (("dynamic", {}),
                                           ("static", dict(cache_implementation="static", max_context=32))):
        target.generation_config.cache_implementation = implementation
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3, **decoder_kwargs)
        request = decoder.add_request(P[0], max_new_tokens=8, do_sample=False)
        while decoder.result(request).finish_reason is None:
            decoder.step()
        assert decoder.result(request).token_ids == expected
    target.generation_config.cache_implementation = "static"
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    with pytest.raises(ValueError, match=r"cache_implementation='static' .* is not the decoder's \('dynamic'\)"):
        decoder.add_request(P[0], max_new_tokens=8, do_sample=False)
    target.generation_config.cache_implementation = "sliding_window"  # (the refusal quoted 'static', its rewrite)
    with pytest.raises(ValueError, match=r"cache_implementation='sliding_window' \(transformers' deprecated name of "
                                         r"its static cache, from the model's generation config\) is not the "
                                         r"decoder's \('dynamic'\)"):
        decoder.add_request(P[0], max_new_tokens=8, do_sample=False)


def test_none_valued_model_inputs_are_not_given(pair):
    """HF's generate skips None-valued keywords (its unused-keyword check reads only values): ours refused
    past_key_values=None, inputs_embeds=None, ... as unsupported keywords, so HF's continue-generation recipe fed with
    our own output (whose past_key_values is None) failed."""
    target, draft = pair
    expected = hf_generate(target, P, max_new_tokens=6)
    for name in ("past_key_values", "inputs_embeds", "position_ids", "token_type_ids", "cache_position",
                 "custom_generate"):
        assert torch.equal(sk.generate(target, P, draft_model=draft, max_new_tokens=6, **{name: None}), expected)
    out = sk.generate(target, P, draft_model=draft, max_new_tokens=3, return_dict_in_generate=True)
    assert out.past_key_values is None
    again = sk.generate(target, out.sequences, draft_model=draft, max_new_tokens=3,
                        past_key_values=out.past_key_values)
    assert torch.equal(again, expected)
    with pytest.raises(ValueError, match="custom_generate"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=6, custom_generate="some/repo")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8])
def test_decoder_input_ids_must_be_integer_ids(dtype):
    """Float (or int16/uint8) decoder_input_ids were cast to int64 silently: [[0., 7.6, 8.2]] generated from
    [0, 7, 8]. Refused by name, as input_ids are."""
    from helpers import seq2seq_models

    target, draft = seq2seq_models.t5(), seq2seq_models.t5(layers=1, seed=5)
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(3))
    decoder_ids = torch.tensor([[0, 7, 8]]).to(dtype)
    with pytest.raises(TypeError, match="decoder_input_ids must be an integer tensor"):
        sk.generate(target, ids, draft_model=draft, decoder_input_ids=decoder_ids, max_new_tokens=4)


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_scores_are_float32_whatever_torchs_default_dtype(pair, default):
    """The score buffers were made in torch's default dtype: with bfloat16 as default (set before building a bf16
    model, a common pattern) output_scores failed inside torch's scatter; with float64 they came back float64 where
    HF's are float32. Both now as HF's."""
    from helpers.float_error import assert_logits_as_accurate_as_hf

    target, draft = pair
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        expected = hf_generate(target, P, **kwargs)
        got = sk.generate(target, P, draft_model=draft, **kwargs)
    finally:
        torch.set_default_dtype(saved)
    assert torch.equal(got.sequences, expected.sequences)
    assert {t.dtype for t in (*got.scores, *got.logits)} == {torch.float32}
    assert_logits_as_accurate_as_hf(target, got, expected)


def test_sampled_tokens_are_the_same_whatever_torchs_default_dtype(pair):
    """Seeded sampling on the CPU (the torch backend's Philox noise and accept uniforms) gives the same tokens with
    float16 as torch's default dtype as with float32. The bits' float conversion took the default dtype (an int64
    tensor times a Python float): the noise was inf/NaN and every token 0 (bfloat16's coarser noise changes fewer
    tokens: test_philox checks the numbers under each default)."""
    target, draft = pair
    kwargs = dict(draft_model=draft, do_sample=True, temperature=0.8, max_new_tokens=12, num_speculative_tokens=3,
                  eos_token_id=None, seed=5)
    expected = sk.generate(target, P, **kwargs)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        got = sk.generate(target, P, **kwargs)
    finally:
        torch.set_default_dtype(saved)
    assert torch.equal(got, expected)


def test_minimums_past_int64_decode_as_model_generate(pair):
    """min_new_tokens / min_length past int64 (model.generate runs them: EOS is masked to the end) failed with a bare
    OverflowError inside our EOS mask; held as max_new_tokens, the same request."""
    target, draft = pair
    for extra in ({"min_new_tokens": 10**20}, {"min_length": 2**64}):
        kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=2, **extra)
        assert torch.equal(sk.generate(target, P, draft_model=draft, **kwargs), hf_generate(target, P, **kwargs))


def test_output_scores_are_checked_before_they_are_copied_out(pair, monkeypatch):
    """The returned scores are a copy of the score buffer (out of inference mode): it was not checked against free
    memory (a second full buffer at the end: peak twice the largest check). A small request's message is in MiB."""
    from speculative_kernels.generation import loop, memory

    target, draft = pair
    checked = []
    real = loop.check_free_memory

    def recording(required, device, what, *args, **kwargs):
        checked.append(what)
        if what.startswith("the returned scores"):
            monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
        return real(required, device, what, *args, **kwargs)

    monkeypatch.setattr(loop, "check_free_memory", recording)
    with pytest.raises(MemoryError, match=r"the returned scores/logits \(1 rows x 4 steps x 97 ids\) needs "
                                          r"1\.5 KiB .* but only 1\.0 KiB are free"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=4, do_sample=False, output_scores=True,
                    return_dict_in_generate=True)


def test_a_targets_schedule_is_refused_only_where_it_would_decide_gamma():
    """A target checkpoint's num_assistant_tokens_schedule: HF's assisted generation reads the draft's, prompt
    lookup none. Refused by name when nothing else decides gamma, with a remedy that works (it named
    num_speculative_tokens='auto', which was refused the same way); given gamma or prompt lookup, it has no effect,
    as in HF. The call's own schedule is still refused."""
    target, draft = llama(), llama(layers=1, seed=2)
    target.generation_config.num_assistant_tokens_schedule = "heuristic"
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule='heuristic'.*pass num_speculative_tokens"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=3)
    expected = hf_generate(target, P, max_new_tokens=6)
    for kwargs in ({"num_speculative_tokens": 3}, {"num_speculative_tokens": "auto"},
                   {"prompt_lookup_num_tokens": 3, "draft_model": None}):
        got = sk.generate(target, P, **{"draft_model": draft, **kwargs}, max_new_tokens=6)
        assert torch.equal(got, expected), kwargs
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        sk.generate(target, P, draft_model=draft, max_new_tokens=3, num_speculative_tokens=3,
                    num_assistant_tokens_schedule="heuristic")


def test_auto_gamma_with_a_checkpoints_prompt_lookup_says_why():
    target = llama()
    target.generation_config.prompt_lookup_num_tokens = 4
    with pytest.raises(ValueError, match="'auto' is not available with prompt lookup .*generation_config"):
        sk.generate(target, P, max_new_tokens=3, num_speculative_tokens="auto")


def test_a_default_device_other_than_the_cpu_changes_nothing():
    """torch's default device set by the caller (``with torch.device("meta")`` while a model skeleton is built,
    ``torch.set_default_device``): model.generate runs; our first call of a process crashed inside torch (the
    import-time probe of the CPU's int64 products made its tensor on the default device), and add_request built its
    host tensors there. A fresh process, since the probe runs once per process."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import torch
        import speculative_kernels as sk
        from helpers.models import llama, perturbed
        target = llama()
        draft = perturbed(target, scale=0.3)
        ids = torch.tensor([[5, 9, 11, 20, 7]])
        expected = target.generate(ids, max_new_tokens=6, do_sample=False)
        with torch.device("meta"):
            got = sk.generate(target, ids, draft_model=draft, max_new_tokens=6, do_sample=False)
            decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
            request = decoder.add_request([5, 9, 11, 20, 7], max_new_tokens=6, do_sample=False)
            while decoder.has_work():
                decoder.step()
        assert torch.equal(got, expected), (got, expected)
        assert decoder.result(request).token_ids == expected[0, 5:].tolist()
        print("ok")
    """)
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=tests, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
