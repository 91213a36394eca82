"""HF's generic encoder-decoder wrappers (``wrapped_seq2seq.py``): EncoderDecoderModel (bert2bert, bert2gpt2,
roberta2roberta), VisionEncoderDecoderModel (ViT with TrOCR's two position rules, GPT-2) and SpeechEncoderDecoderModel
(Wav2Vec2 with BERT, GPT-2; Wav2Vec2-BERT reading input_features): greedy tokens identical to ``model.generate`` at
batch 1 and in a padded batch of 2, on the dynamic and the static cache and compiled (aot_eager), with a draft the
target rejects now and then; sampling against model.generate's exact distribution; the decoders refused by name."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import speculative_kernels as sk
from speculative_kernels import CompileOptions
from helpers.models import perturbed
from helpers.seq2seq_models import source_batch
from helpers.wrapped_models import (audio, features, features_wrapper, images, speech_wrapper, text_wrapper,
                                    text_wrapper_of, vision_wrapper)

WRAPPERS = {
    "bert2bert": lambda **k: text_wrapper("bert", "bert", **k),
    "bert2gpt2": lambda **k: text_wrapper("bert", "gpt2", **k),
    "roberta2roberta": lambda **k: text_wrapper("roberta", "roberta", **k),
    "vit-trocr": lambda **k: vision_wrapper("trocr", **k),
    "vit-trocr-sinusoidal": lambda **k: vision_wrapper("trocr-sinusoidal", **k),
    "vit-gpt2": lambda **k: vision_wrapper("gpt2", **k),
    "wav2vec2-bert": lambda **k: speech_wrapper("bert", **k),
}


@pytest.fixture(scope="module")
def pairs():
    """name -> (target, a perturbed copy as its draft)."""
    out = {}
    for name, make in WRAPPERS.items():
        target = make()
        out[name] = (target, perturbed(target, 0.1))
    return out


def _inputs(target, rows: int, other_lengths: bool = False):
    """(positional encoder input, keywords) of ``rows`` rows, padded where the input can be; other_lengths: a batch
    of 2 of other source lengths (other images)."""
    kind, seed = target.config.model_type, rows + 10 * other_lengths
    if kind == "vision-encoder-decoder":
        return images(rows, seed=seed), {}
    if kind == "speech-encoder-decoder":
        values, mask = audio([40] if rows == 1 else [36, 52] if other_lengths else [28, 40], seed=seed)
        return values, {"attention_mask": mask}
    lengths = [7] if rows == 1 else [6, 11] if other_lengths else [5, 9]
    ids, mask = source_batch(lengths, seed=seed, pad=target.config.encoder.pad_token_id)
    return ids, {"attention_mask": mask}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("rows", [1, 2])
def test_greedy_matches_hf(pairs, name, cache, rows):
    target, draft = pairs[name]
    source, kwargs = _inputs(target, rows)
    expected = target.generate(source, **kwargs, do_sample=False, max_new_tokens=16)
    stats = sk.SpeculationStats()
    got = sk.generate(target, source, **kwargs, draft_model=draft, num_speculative_tokens=3, do_sample=False,
                      max_new_tokens=16, speculation_stats=stats,
                      **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, expected), (got, expected)
    assert stats.accepted_histogram[0] > 0  # rejections rolled the caches back


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,path", [(name, path) for name in ("bert2gpt2", "vit-trocr", "wav2vec2-bert")
                                       for path in ("dynamic", "static")] + [("bert2gpt2", "compiled")])
def test_wrappers_on_cuda_match_hf(pairs, name, path):
    """The three wrappers on a CUDA device, a padded batch of 2 (compile=True with inductor for one: each compile
    takes tens of seconds). Not TrOCR's sinusoidal positions: their table is a plain attribute that ``.cuda()`` leaves
    on the CPU, where HF's own forward indexes it with CUDA ids."""
    target, draft = (copy.deepcopy(model).cuda() for model in pairs[name])  # the fixture's stay on the CPU
    source, kwargs = _inputs(target, 2)
    source, kwargs = source.cuda(), {key: value.cuda() for key, value in kwargs.items()}
    expected = target.generate(source, **kwargs, do_sample=False, max_new_tokens=16)
    extra = {"dynamic": {}, "static": {"cache_implementation": "static"}, "compiled": {"compile": True}}[path]
    got = sk.generate(target, source, **kwargs, draft_model=draft, num_speculative_tokens=3, do_sample=False,
                      max_new_tokens=16, **extra)
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("name", ["bert2gpt2", "vit-trocr", "wav2vec2-bert"])
def test_compiled_matches_hf_and_sources_of_other_lengths_reuse_the_steps(name):
    """compile=True (dynamo with the aot_eager backend, as the suite's other compiled tests) for one wrapper of each
    kind: greedy tokens identical to model.generate in a padded batch of 2, with rejections; a second batch of other
    source lengths (other images for ViT, whose source is always 4 patches) compiles nothing new. The speech
    wrapper's source is padded to buckets (its frames and the audio mask its forward derives their mask from,
    ``StaticSeq2SeqRunner._pad_speech_source``): without it every new audio length compiled three graphs. One-layer
    models (each trace takes seconds per layer)."""
    target = WRAPPERS[name](layers=1)
    draft = perturbed(target, 0.1)
    for call in range(2):
        source, kwargs = _inputs(target, 2, other_lengths=call == 1)
        expected = target.generate(source, **kwargs, do_sample=False, max_new_tokens=12)
        graphs, stats = counters["stats"]["unique_graphs"], sk.SpeculationStats()
        got = sk.generate(target, source, **kwargs, draft_model=draft, num_speculative_tokens=3, do_sample=False,
                          max_new_tokens=12, compile=CompileOptions(backend="aot_eager"), speculation_stats=stats)
        assert torch.equal(got, expected), (call, got, expected)
        assert stats.accepted_histogram[0] > 0
    assert counters["stats"]["unique_graphs"] == graphs  # the second call compiled nothing new


@pytest.mark.parametrize("silent_row", [False, True])
def test_speech_source_padded_to_buckets_where_its_mask_derivation_allows(pairs, silent_row):
    """The compiled path's padding of a speech source (``StaticSeq2SeqRunner._pad_source``), applied by hand to the
    eager static runners (the compiled test's graph count shows it is applied there): frames and audio mask padded,
    the output still model.generate's. Not padded where a row has no real audio sample: Wav2Vec2's derivation then
    flags that row's last frame of whatever width and so attends to every frame, padding included (a mutant padding
    without the check fails the shape assertion; this tiny model's tokens do not change)."""
    from speculative_kernels.generation.request import build_loop
    from speculative_kernels.generation.runners.sizing import captured_capacity

    target, draft = pairs["wav2vec2-bert"]
    values, mask = audio([28, 40], seed=3)
    if silent_row:
        mask[0] = 0
    kwargs = dict(do_sample=False, max_new_tokens=12)
    expected = target.generate(values, attention_mask=mask, **kwargs)
    with torch.inference_mode():
        loop = build_loop(target, draft, values, attention_mask=mask, num_speculative_tokens=3,
                          cache_implementation="static", **kwargs)
        runners = (loop.target_runner, loop.drafter.runner)
        assert not any(r.cache.cross_attention_cache.layers for r in runners)  # (no forward yet: as capture() finds)
        frames = runners[0].encoder_outputs.last_hidden_state.shape[1]
        for runner in runners:
            runner._pad_source()
        padded = runners[0].encoder_outputs.last_hidden_state.shape[1]
        assert (padded, runners[0]._cross_mask.shape[1]) == ((frames, 40) if silent_row else
                                                              (captured_capacity(frames), captured_capacity(40)))
        got, _ = loop.run()
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_speech_encoder_reading_input_features_matches_hf(cache):
    """A speech wrapper whose encoder reads input_features [B, T, F] (Wav2Vec2-BERT; Speech2Text's encoder reads them
    too) rather than input_values: positionally and as input_features=, a padded batch of 2 whose mask changes the
    tokens (its forward derives the frames' mask from it, through the adapter's halving), with rejections."""
    target = features_wrapper()
    draft = perturbed(target, 0.1)
    values, mask = features([15, 24], seed=2)
    kwargs = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_logits=True)
    expected = target.generate(values, attention_mask=mask, **kwargs)
    assert not torch.equal(expected.sequences, target.generate(values, **kwargs).sequences)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    for given in ({"input_ids": values}, {"input_features": values}):
        stats = sk.SpeculationStats()
        got = sk.generate(target, **given, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                          speculation_stats=stats, **kwargs, **extra)
        assert torch.equal(got.sequences, expected.sequences), (list(given), got.sequences, expected.sequences)
        # (the logits too: the encoder's own use of the mask, over row 0's padded frames, moves them by up to 8e-3
        #  without changing a token)
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)
        assert stats.accepted_histogram[0] > 0
    with pytest.raises(ValueError, match=r"input_values is not read by SpeechEncoderDecoderModel's encoder "
                                         r"\(Wav2Vec2BertModel, which reads input_features\)"):
        sk.generate(target, input_values=values, attention_mask=mask, draft_model=draft, max_new_tokens=4)


@pytest.mark.parametrize("decoder,seed,source", [("bert-generation", 1, 2), ("electra", 0, 2), ("xlm-roberta", 1, 3),
                                                  ("bart", 3, 3), ("marian", 0, 2)])
def test_other_wrapped_decoders_match_hf(decoder, seed, source):
    """More of ``WRAPPED_DECODER_POSITIONS``' decoders (each position kind) behind a BERT encoder, padded batch of 2
    (the others of the table were swept the same way, 4 seeds each, dynamic and static). Seeds where the tokens
    differ without the runners' positions (no decoder_position_ids, no position hooks)."""
    target = text_wrapper_of(decoder, seed=seed)
    ids, mask = source_batch([5, 9], seed=source, pad=0)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, draft_model=perturbed(target, 0.15), num_speculative_tokens=3,
                      do_sample=False, max_new_tokens=16, speculation_stats=stats)
    assert torch.equal(got, expected), (got, expected)
    assert stats.accepted_histogram[0] > 0


def test_bart_decoder_with_other_encoder_head_count_on_the_static_cache():
    """A BART-family decoder config maps num_attention_heads and num_hidden_layers to its (unused) encoder's: the
    static cache is sized from decoder_attention_heads / decoder_layers (mBART decoders of Donut-like wrappers).
    (Layer counts must agree anyway: model.generate's own cache is built from num_hidden_layers.)"""
    target = text_wrapper_of("bart", seed=3)
    target.config.decoder.encoder_attention_heads = 2  # (read as num_attention_heads; the decoder has 4)
    ids, mask = source_batch([5, 9], seed=3, pad=0)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=perturbed(target, 0.15), num_speculative_tokens=3,
                      do_sample=False, max_new_tokens=12, cache_implementation="static")
    assert torch.equal(got, expected), (got, expected)


def test_encoder_and_decoder_vocabularies_of_other_sizes():
    """bert2gpt2-like: the wrapper's get_input_embeddings is its encoder's, whose vocabulary (60 ids) the decoder's
    start and prompt ids (140, 145) run past: checked against the decoder's (refused before). A source of 140 ids
    holding the decoder's first tokens followed by ids past its 97: prompt lookup must not propose those (an
    IndexError in the decoder's embedding before); the source is searched only where both vocabularies agree."""
    small = text_wrapper("bert", "gpt2", encoder_vocab=60)
    small.generation_config.decoder_start_token_id = 90
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    decoder_ids = torch.tensor([[90, 95], [90, 80]])
    expected = small.generate(ids, decoder_input_ids=decoder_ids, do_sample=False, max_new_tokens=8)
    got = sk.generate(small, ids, decoder_input_ids=decoder_ids, draft_model=perturbed(small, 0.1),
                      do_sample=False, max_new_tokens=8)
    assert torch.equal(got, expected), (got, expected)
    large = text_wrapper("bert", "gpt2", encoder_vocab=140)
    first = large.generate(torch.tensor([[5, 6, 7]]), do_sample=False, max_new_tokens=2)[0, 1:].tolist()
    source = torch.tensor([[5, *first, 120, 130, 135, 7]])
    expected = large.generate(source, do_sample=False, max_new_tokens=8)
    got = sk.generate(large, source, prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=8)
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("name", ["bert2gpt2", "vit-trocr-sinusoidal"])
def test_drafting_without_a_model_matches_hf(pairs, name):
    """Prompt lookup (over the decoder's tokens; a token source too) and the n-gram drafter."""
    target, _ = pairs[name]
    source, kwargs = _inputs(target, 2)
    expected = target.generate(source, **kwargs, do_sample=False, max_new_tokens=16)
    for drafting in ({"prompt_lookup_num_tokens": 3}, {"drafter": sk.NGramDrafter(target.config.decoder.vocab_size)}):
        got = sk.generate(target, source, **kwargs, **drafting, do_sample=False, max_new_tokens=16)
        assert torch.equal(got, expected), (drafting, got, expected)


def test_encoder_input_by_keyword_and_a_smaller_wrapper_as_draft(pairs):
    """pixel_values= as model.generate takes it; an unrelated smaller wrapper of the same vocabulary drafts."""
    target, _ = pairs["vit-gpt2"]
    pixels = images(2, seed=5)
    expected = target.generate(pixel_values=pixels, do_sample=False, max_new_tokens=12)
    got = sk.generate(target, pixel_values=pixels, draft_model=vision_wrapper("gpt2", layers=1, hidden=16, seed=9),
                      do_sample=False, max_new_tokens=12)
    assert torch.equal(got, expected), (got, expected)


def test_roberta_decoder_pad_tokens_in_the_decoder_prompt_as_in_hf(pairs):
    """RoBERTa numbers a pad token's position pad_token_id and the others from the pad id on: the trailing pad tokens
    of these decoder prompts take the pad position, as in model.generate; a pad token before another is refused."""
    target, draft = pairs["roberta2roberta"]
    ids, mask = source_batch([5, 9], seed=2, pad=1)
    decoder_ids = torch.tensor([[3, 5, 9, 1], [3, 7, 1, 1]])
    kwargs = dict(attention_mask=mask, decoder_input_ids=decoder_ids, do_sample=False, max_new_tokens=12,
                  return_dict_in_generate=True, output_logits=True)
    expected = target.generate(ids, **kwargs)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs)
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    # (the first logits are read at a pad token: its position moves them by ~0.3, which need not change a token)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"decoder_input_ids has the pad token \(1\) before another token: model "
                                         r"\(EncoderDecoderModel\)"):
        sk.generate(target, ids, attention_mask=mask, decoder_input_ids=torch.tensor([[3, 1, 5], [3, 4, 5]]),
                    draft_model=draft, max_new_tokens=4)


def test_roberta_decoder_numbers_from_its_own_pad_id_not_the_wrappers(pairs):
    """The wrapper's config.pad_token_id (0 here, e.g. a BERT encoder's) is not the RoBERTa decoder's (1), whose
    embeddings number positions from their own padding_idx: the runners read the decoder's (a mutant reading the
    wrapper's passed every test, where the two agree)."""
    target = copy.deepcopy(pairs["roberta2roberta"][0])
    target.config.pad_token_id = 0
    ids, mask = source_batch([7], seed=5, pad=1)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    got = sk.generate(target, ids, attention_mask=mask, prompt_lookup_num_tokens=2, do_sample=False,
                      max_new_tokens=10)
    assert torch.equal(got, expected), (got, expected)


def test_trocr_sinusoidal_pad_tokens_in_the_decoder_prompt_as_in_hf(pairs):
    """TrOCR's sinusoids (numbered from its pad id, ``absolute_skipping_pads``) give a pad token the pad's zero row:
    the runners' hook must too. A decoder prompt ending in pad tokens, as model.generate numbers it (a hook that
    numbered the pad like the other tokens passed every other test)."""
    target, draft = pairs["vit-trocr-sinusoidal"]
    pad, start = target.config.decoder.pad_token_id, target.generation_config.decoder_start_token_id
    decoder_ids = torch.tensor([[start, 5, pad], [start, pad, pad]])
    kwargs = dict(decoder_input_ids=decoder_ids, do_sample=False, max_new_tokens=8, return_dict_in_generate=True,
                  output_logits=True)
    expected = target.generate(images(2, seed=4), **kwargs)
    got = sk.generate(target, images(2, seed=4), draft_model=draft, num_speculative_tokens=3, **kwargs)
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)


def test_unreviewed_wrapped_decoder_is_refused_by_name():
    from transformers import EncoderDecoderConfig, EncoderDecoderModel, RoFormerConfig

    from helpers.wrapped_models import _bert

    decoder = RoFormerConfig(vocab_size=97, hidden_size=16, embedding_size=16, num_hidden_layers=1,
                             num_attention_heads=2, intermediate_size=32)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(_bert(1, 16), decoder)
    config.decoder_start_token_id, config.pad_token_id = 3, 0
    model = EncoderDecoderModel(config=config).eval()
    with pytest.raises(ValueError, match=r"model \(EncoderDecoderModel, model_type 'encoder-decoder'\) wraps a "
                                         r"decoder of type 'roformer', which speculative_kernels does not drive "
                                         r"inside a wrapper"):
        sk.generate(model, torch.tensor([[5, 6, 7]]), prompt_lookup_num_tokens=2, max_new_tokens=4)


def test_bert_decoder_without_is_decoder_is_refused_by_name():
    """A wrapper built from configs that leave the BERT decoder's is_decoder False (transformers' default config of
    EncoderDecoderConfig): bidirectional and cache-less, model.generate re-encodes the decoder sequence each step."""
    from transformers import EncoderDecoderConfig, EncoderDecoderModel

    from helpers.wrapped_models import _bert

    config = EncoderDecoderConfig(encoder=_bert(1, 16).to_dict(), decoder=_bert(1, 16).to_dict(),
                                  decoder_start_token_id=3)  # (from_encoder_decoder_configs would set it True)
    model = EncoderDecoderModel(config=config).eval()
    with pytest.raises(ValueError, match=r"model \(EncoderDecoderModel\) wraps a bert decoder with is_decoder=False: "
                                         r"it attends bidirectionally and keeps no cache"):
        sk.generate(model, torch.tensor([[5, 6, 7]]), prompt_lookup_num_tokens=2, max_new_tokens=4)


def test_wrapper_inputs_refused_by_name(pairs):
    vision, _ = pairs["vit-gpt2"]
    with pytest.raises(ValueError, match=r"attention_mask is not taken by VisionEncoderDecoderModel"):
        sk.generate(vision, images(1), attention_mask=torch.ones(1, 4), prompt_lookup_num_tokens=2, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"pixel_values must be a floating-point tensor"):
        sk.generate(vision, torch.ones(1, 3, 16, 16, dtype=torch.int64), prompt_lookup_num_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"pixel_values must be a \[batch, \.\.\.\] tensor with at least one row"):
        sk.generate(vision, torch.ones(0, 3, 16, 16), prompt_lookup_num_tokens=2, max_new_tokens=4)
    speech, _ = pairs["wav2vec2-bert"]
    with pytest.raises(ValueError, match=r"input_features is not read by SpeechEncoderDecoderModel's encoder "
                                         r"\(Wav2Vec2Model, which reads input_values\)"):  # (HF: a bos_token_id error)
        sk.generate(speech, input_features=audio([8])[0], prompt_lookup_num_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"input_values is not read by VisionEncoderDecoderModel's encoder"):
        sk.generate(vision, input_values=images(1), prompt_lookup_num_tokens=2, max_new_tokens=4)
    # (HF's processors reading the encoder's ids: model.generate ignores them with a warning here, and 5.17's
    #  encoder_repetition_penalty fails on input_values; the runners ignored them with HF's warning)
    for setting in ({"encoder_repetition_penalty": 1.5}, {"encoder_no_repeat_ngram_size": 2}):
        name = next(iter(setting))
        with pytest.raises(ValueError, match=rf"{name}=\S+ reads the encoder's token ids, and "
                                             r"SpeechEncoderDecoderModel's encoder reads input_values"):
            sk.generate(speech, audio([8])[0], **setting, prompt_lookup_num_tokens=2, max_new_tokens=4)
    text, _ = pairs["bert2gpt2"]
    with pytest.raises(ValueError, match=r"model's encoder reads pixel_values but draft_model's reads input_ids"):
        sk.generate(vision, images(1), draft_model=text, max_new_tokens=4)


@pytest.mark.parametrize("name,fits", [("vit-trocr-sinusoidal", 64), ("roberta2roberta", 68)])
def test_decoder_position_limit_as_in_hf(pairs, name, fits):
    """model.generate fails inside the decoder's table (IndexError) one token past ``fits`` new tokens: TrOCR's
    sinusoids, which one-token steps never grow (the runners' hooks would read a clamped row instead), and RoBERTa's
    table, whose first rows lie below its pad id + 1. Refused by name there, not before."""
    target, _ = pairs[name]
    source, kwargs = _inputs(target, 1)
    kwargs.update(prompt_lookup_num_tokens=2, do_sample=False, eos_token_id=None)
    assert sk.generate(target, source, max_new_tokens=fits, **kwargs).shape[1] == fits + 1
    with pytest.raises(ValueError, match=rf"model \({type(target).__name__}\) has a learned position table of "):
        sk.generate(target, source, max_new_tokens=fits + 1, **kwargs)


def test_learned_table_up_to_its_end_in_a_batch_as_in_hf(pairs):
    """TrOCR's learned table (64 positions) up to the last row a batch of 2 with 4 drafts may reach: its rows accept
    different counts and sit right-aligned in a cache wider than the longest, from whose width HF's own lookup
    (cache_length) would read past the table, an IndexError where every true position fits; the runners' pre-hook
    starts that lookup from 0 (``_inside_table``; a mutant without it passed every other test)."""
    target, draft = pairs["vit-trocr"]
    kwargs = dict(do_sample=False, max_new_tokens=60, eos_token_id=None)
    expected = target.generate(images(2, seed=6), **kwargs)
    got = sk.generate(target, images(2, seed=6), draft_model=draft, num_speculative_tokens=4, **kwargs)
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("decoder,seed", [("bart", 3), ("marian", 0)])
def test_bart_family_decoder_table_up_to_its_end_in_a_batch_as_in_hf(decoder, seed):
    """A BART-family decoder (BartForCausalLM, MarianForCausalLM) in a wrapper, up to the last row of its table (64
    positions; BART's holds 2 more, its offset) in a batch of 2 with 4 drafts: its decoder computes the position ids
    itself from the cache's width (arange + cache_length, handed to the table as ``position_ids``), which with rows
    right-aligned in a cache wider than the longest run past the table where every true position fits. The runners'
    pre-hook clamps them into the table (``_inside_table``; the forward hook then reads the true positions): mutants
    without that clamp, or clamping one row further, or not subtracting BART's offset, passed every other wrapper
    test (TrOCR's table is given cache_length alone). Then one row to the table's last position (63; a batch of 2
    with 4 drafts stops 4 earlier, ``check_position_table``'s overshoot): the true positions are clamped before the
    offset is added (a mutant adding it first read row 63 at positions 62 and 63 and passed every other test)."""
    target = text_wrapper_of(decoder, seed=seed)
    draft = perturbed(target, 0.15)
    ids, mask = source_batch([5, 9], seed=seed, pad=0)
    for rows, new in ((2, 60), (1, 64)):
        kwargs = dict(attention_mask=mask[:rows], do_sample=False, max_new_tokens=new, eos_token_id=None)
        expected = target.generate(ids[:rows], **kwargs)
        got = sk.generate(target, ids[:rows], draft_model=draft, num_speculative_tokens=4, **kwargs)
        assert torch.equal(got, expected), (rows, got, expected)


@pytest.mark.parametrize("drafting", ["draft_model", "prompt_lookup"])
def test_sampling_with_return_sequences_follows_hfs_distribution(drafting):
    """Sampling (num_return_sequences=2000 of one source): a bert2gpt2 over a 6-token decoder vocabulary, every
    3-token continuation's frequency against its exact probability under model.generate's steps and processors
    (helpers.sampling.hf_chain_probs, EOS 2 then pad 0 as model.generate ends a row; chi-square, the suite's
    helpers.stats)."""
    import numpy as np
    from transformers import EncoderDecoderConfig, EncoderDecoderModel, GenerationConfig

    from helpers.sampling import NEW, VOCAB, hf_chain_probs
    from helpers.stats import assert_matches
    from helpers.wrapped_models import _bert, _gpt2, _sensitive

    torch.manual_seed(0)
    decoder = _gpt2(1, 16)
    decoder.vocab_size, decoder.is_decoder, decoder.add_cross_attention = VOCAB, True, True
    config = EncoderDecoderConfig.from_encoder_decoder_configs(_bert(1, 16), decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 3, 0, 2
    target = _sensitive(EncoderDecoderModel(config=config).eval(), 0)
    source, mask = torch.tensor([[5, 6, 7, 8, 9]]), torch.ones(1, 5, dtype=torch.long)
    generation = GenerationConfig(do_sample=True, top_k=0, temperature=0.1, max_new_tokens=NEW)
    extra = (dict(draft_model=perturbed(target, 0.3), num_speculative_tokens=2) if drafting == "draft_model"
             else dict(prompt_lookup_num_tokens=2))
    torch.manual_seed(1)
    out = sk.generate(target, source, attention_mask=mask, generation_config=generation, num_return_sequences=2000,
                      **extra)
    codes = (out[:, 1:].numpy() * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), hf_chain_probs(target, source, mask, generation, eos=2))


@pytest.mark.parametrize("name,source_length", [("vit-gpt2", 5), ("wav2vec2-bert", 10), ("bert2gpt2", 7)])
def test_the_memory_check_counts_each_sources_cross_attention_and_encoder_output(pairs, monkeypatch, name,
                                                                                 source_length):
    """The static caches' memory check counted the decoders' cross-attention K/V and the encoder outputs from the
    encoder's token ids only: a vision or speech source (no ids) counted neither, and a text wrapper's encoder output
    counted 0 bytes (its config has no width). Measured (random weights, target as its own draft, batch 1, gamma 5,
    64 new tokens): ViT-B/16 at 224 px + GPT-2 (S = 197), 40.0 MiB where 11.1 were counted; Wav2Vec2-base + BERT-base
    on 30 s of audio (S = 1499), 230.7 MiB where 11.1 were. S here: ViT's 4 patches and its CLS token, Wav2Vec2's 40
    samples through two stride-2 convolutions, bert2gpt2's 7 source tokens."""
    from speculative_kernels.generation.capabilities import check_model
    from speculative_kernels.generation.runners import factory
    from speculative_kernels.generation.runners.slot_cache import CacheLayout

    seen = []
    monkeypatch.setattr(factory, "check_free_memory", lambda required, *args, **kwargs: seen.append(required))
    target, draft = pairs[name]
    source, kwargs = _inputs(target, rows=1)
    sk.generate(target, source, **kwargs, draft_model=draft, num_speculative_tokens=3, do_sample=False,
                max_new_tokens=6, cache_implementation="static")
    (required,) = seen
    layouts = [CacheLayout.of(m, check_model(m, path="static", batch=1)) for m in (target, draft)]
    hidden = target.config.encoder.hidden_size
    assert required["cross_attention_kv"] == sum(layout.bytes(1, source_length) for layout in layouts) > 0
    assert required["encoder_outputs"] == 2 * source_length * hidden * 4
    assert required["total"] == sum(v for k, v in required.items() if k != "total")
