"""Architecture families beyond plain full attention: exact on every path that accepts them, refused up front
(``capabilities.py``) on every path that does not. One representative per family of docs/architectures.md; the
full sweep over every config class is ``benchmarks/coverage.py``."""


import pytest
import torch
from transformers import (
    BartConfig,
    BartForCausalLM,
    BertConfig,
    BertLMHeadModel,
    BloomConfig,
    BloomForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    MusicgenDecoderConfig,
    MusicgenForCausalLM,
    SiglipVisionConfig,
    FalconConfig,
    FalconForCausalLM,
    FalconMambaConfig,
    FalconMambaForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MegatronBertConfig,
    MegatronBertForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MptConfig,
    MptForCausalLM,
    OpenAIGPTConfig,
    OpenAIGPTLMHeadModel,
    RecurrentGemmaConfig,
    RecurrentGemmaForCausalLM,
    RemBertConfig,
    RemBertForCausalLM,
    RoFormerConfig,
    RoFormerForCausalLM,
    RwkvConfig,
    RwkvForCausalLM,
)

import speculative_kernels as sk
from speculative_kernels import CompileOptions
from speculative_kernels.generation import request as request_module
from speculative_kernels.generation.capabilities import check_model
from helpers.models import perturbed

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
PATHS = {"dynamic": {}, "static": {"cache_implementation": "static"},
         "compile": {"compile": CompileOptions(backend="aot_eager")}}


def _build(model_class, config, seed: int = 0):
    """Untied output embeddings: tied tiny random models tend to repeat their input, which any draft guesses."""
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    return model_class(config).eval()


def _batch(batch: int, pad: int = 4, length: int = 10):
    ids = torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def _check_exact(target, *, batch: int, path: str = "dynamic", noise: float | None = 0.3, new: int = 12):
    """noise None: the draft is the same architecture with other random weights (rejects more)."""
    draft = perturbed(target, noise) if noise is not None else _build(type(target), target.config, seed=1)
    ids, mask = _batch(batch)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                      max_new_tokens=new, do_sample=False, pad_token_id=0, speculation_stats=stats, **PATHS[path])
    assert torch.equal(got, expected)
    assert stats.acceptance_rate < 1.0  # the draft was rejected somewhere: rollbacks were exercised


def _no_loop(*args, **kwargs):
    raise AssertionError("a runner or loop (and its caches) was built for a model that should be refused")


def _check_refused_up_front(model, match: str, *, batch: int = 2, path: str = "dynamic", monkeypatch=None):
    """generate raises ValueError naming the architecture before any runner or cache exists."""
    ids, mask = _batch(batch)
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=f"{type(model).__name__}.*{match}"):
        patch.setattr(request_module, "make_runner", _no_loop)
        patch.setattr(request_module, "SpeculativeLoop", _no_loop)
        sk.generate(model, ids, attention_mask=mask, draft_model=model, num_speculative_tokens=3, max_new_tokens=4,
                    pad_token_id=0, **PATHS[path])
    with pytest.raises(ValueError, match=match):
        check_model(model, path=path, batch=batch)


# ------------------------------------------------------------------------------------------- sliding windows
def mistral_window():
    return _build(MistralForCausalLM, MistralConfig(**SIZES, sliding_window=6))


def gemma2_window():  # interleaved sliding / full layers: the masks go in as a dict keyed by layer type
    return _build(Gemma2ForCausalLM, Gemma2Config(**SIZES, head_dim=8, sliding_window=6,
                                                  layer_types=["sliding_attention", "full_attention"]))


def gpt_oss_window():
    return _build(GptOssForCausalLM, GptOssConfig(**SIZES, head_dim=8, sliding_window=6, num_local_experts=4,
                                                  num_experts_per_tok=2,
                                                  layer_types=["sliding_attention", "full_attention"]))


@pytest.mark.parametrize("make", [mistral_window, gemma2_window, gpt_oss_window])
@pytest.mark.parametrize("path", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 2])
def test_sliding_window_smaller_than_the_sequence_is_exact(make, path, batch):
    _check_exact(make(), batch=batch, path=path)


def test_sliding_window_compiled_is_exact():
    _check_exact(gemma2_window(), batch=1, path="compile")


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_a_window_of_one_position_is_refused_past_it(path):
    """sliding_window=1: HF's sliding cache keeps every slot at window 1 (its prefill applies the window, its
    one-token steps attend to the whole cache), so model.generate's tokens are neither the windowed model's nor the
    unwindowed one's. Ours (the window in every forward) differed silently; such a request is refused by name, and
    one the window spans (prompt of one token, one new token) still runs."""
    model = _build(MistralForCausalLM, MistralConfig(**SIZES, sliding_window=1))
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="MistralForCausalLM's config sets sliding_window=1, where HF's sliding cache"):
        sk.generate(model, ids, draft_model=model, num_speculative_tokens=3, max_new_tokens=4, **PATHS[path])
    decoder = sk.SpeculativeDecoder(model, model, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="sliding_window=1, where HF's sliding cache"):
        decoder.add_request([5, 6], max_new_tokens=1)
    one = torch.tensor([[5]])
    assert torch.equal(sk.generate(model, one, draft_model=model, num_speculative_tokens=3, max_new_tokens=1,
                                   **PATHS[path]), model.generate(one, max_new_tokens=1, do_sample=False))


# ------------------------------------------------------------------------------------------- ALiBi
def bloom():
    return _build(BloomForCausalLM, BloomConfig(vocab_size=97, hidden_size=32, n_layer=2, n_head=4, bos_token_id=1,
                                                eos_token_id=2, pad_token_id=0, tie_word_embeddings=False))


def falcon_alibi():
    return _build(FalconForCausalLM, FalconConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, alibi=True, new_decoder_architecture=True,
                                                  num_kv_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                  tie_word_embeddings=False))


@pytest.mark.parametrize("make", [bloom, falcon_alibi])
@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_alibi_from_the_slot_mask_is_exact_in_a_padded_batch(make, path):
    _check_exact(make(), batch=2, path=path, noise=None)


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_a_config_with_return_dict_false_is_exact(path):
    """config.return_dict=False (a checkpoint's config.json, or torchscript=True): model.generate asks every forward
    for return_dict=True, and so do the runners; Bloom and Falcon, whose forwards honour the config, returned tuples
    (an AttributeError inside generate) before."""
    model = bloom()
    model.config.return_dict = False
    _check_exact(model, batch=2, path=path, noise=None)


def falcon_multi_query():
    return _build(FalconForCausalLM, FalconConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, bos_token_id=1, eos_token_id=2,
                                                  pad_token_id=0))  # multi_query=True: one K/V head


def _check_continuous(model, static: bool = True, new: int = 10):
    """Two requests of different lengths, the second joining after the first step (on the static cache: rows for 4
    requests, joining in place): each equals model.generate on it alone, with rejections on the way."""
    caches = dict(cache_implementation="static", max_context=24, max_batch_size=4) if static else {}
    decoder = sk.SpeculativeDecoder(model, perturbed(model, 0.3), num_speculative_tokens=3, **caches)
    prompts = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5)]
    requests = [decoder.add_request(prompts[0], max_new_tokens=new, do_sample=False)]
    decoder.step()
    requests.append(decoder.add_request(prompts[1], max_new_tokens=new, do_sample=False))
    while any(decoder.result(r).finish_reason is None for r in requests):
        decoder.step()
    results = [decoder.result(r) for r in requests]
    for prompt, result in zip(prompts, results):
        expected = model.generate(prompt[None], max_new_tokens=new, do_sample=False, pad_token_id=0)
        assert result.token_ids == expected[0, len(prompt):].tolist()
    assert sum(r.accepted_tokens for r in results) < sum(r.drafted_tokens for r in results)


def test_falcon_multi_query_is_exact_on_the_static_cache():
    """Falcon with multi_query=True (and not new_decoder_architecture) caches one K/V head, not the config's head
    count: the static cache sizes its buffers so (it refused the model before), batch 2 left-padded and rows joining
    in continuous batching. (compile=True traces the same cache: benchmarks/coverage.py's sweep runs it.)"""
    model = falcon_multi_query()
    assert check_model(model, path="static", batch=2).kv_sizes == ((1, 8, 8),) * 2
    _check_exact(model, batch=2, path="static")
    _check_continuous(model)


def gemma4_per_layer_sizes(shared: int = 0):
    """Gemma 4 text: its heterogeneous config (per_layer_config) gives the global layers other K/V heads and head
    size (attention_k_eq_v: 1 head of 16) than the sliding ones (2 heads of 8); ``shared``: its last layers reuse the
    K/V of the last earlier layer of their type (transformers 5.24 gives them dummy cache layers)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    kinds = ["sliding_attention", "full_attention"] * (1 + shared)
    # (per-layer inputs: transformers 5.24's Gemma 4 with shared layers and none fails inside model.generate)
    config = Gemma4TextConfig(**{**SIZES, "num_hidden_layers": len(kinds)}, head_dim=8, global_head_dim=16,
                              num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2 * shared,
                              hidden_size_per_layer_input=4 if shared else 0, vocab_size_per_layer_input=97,
                              sliding_window=6, layer_types=kinds)
    return _build(Gemma4ForCausalLM, config)


def test_layers_of_their_own_sizes_are_exact_on_the_static_cache():
    """A heterogeneous config (per_layer_config) sizes each layer's K/V: the static cache allocates each layer's
    buffers so (it refused such configs before), batch 2 left-padded and rows joining in continuous batching."""
    model = gemma4_per_layer_sizes()
    assert check_model(model, path="static", batch=2).kv_sizes == ((2, 8, 8), (1, 16, 16))
    _check_exact(model, batch=2, path="static")
    _check_continuous(model)


def test_layers_sharing_kv_are_exact_on_the_static_cache():
    """Gemma 4's KV-sharing layers (num_kv_shared_layers) keep no cache of their own (transformers 5.24: dummy cache
    layers) and attend to the K/V of the last earlier layer of their type, as its cache update returns them: the
    static cache gives them HF's DummyLayer and no buffers (it refused them before), batch 2 left-padded and rows
    joining in continuous batching."""
    model = gemma4_per_layer_sizes(shared=1)
    sizes = check_model(model, path="static", batch=2).kv_sizes
    assert sizes[:2] == ((2, 8, 8), (1, 16, 16)) and len(sizes) == 4
    _check_exact(model, batch=2, path="static")
    _check_continuous(model)


def test_decoder_heads_other_than_the_configs_refused_on_the_static_cache(monkeypatch):
    """WhisperForCausalLM: num_attention_heads / num_key_value_heads name the encoder's heads, so the static cache
    sized from them would not fit the decoder's K/V (it failed mid-request before the check knew it)."""
    from transformers import WhisperConfig, WhisperForCausalLM

    config = WhisperConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_target_positions=64, max_source_positions=64, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0, decoder_start_token_id=1)
    model = _build(WhisperForCausalLM, config)
    model.generation_config.begin_suppress_tokens = model.generation_config.suppress_tokens = None  # refused by name
    _check_exact(model, batch=1, path="dynamic")
    _check_refused_up_front(model, "attention heads", path="static", monkeypatch=monkeypatch)


# ------------------------------------------------------------------------------------------- slot positions
def test_models_counting_positions_from_cache_slots_are_exact_at_batch_one_only(monkeypatch):
    """BART's decoder alone and MPT (ALiBi from key slots) take no position_ids: rejected drafts leave holes in a
    batch, so batch > 1 is refused; batch 1 has no holes."""
    bart = _build(BartForCausalLM, BartConfig(vocab_size=97, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                              encoder_attention_heads=4,
                                              decoder_ffn_dim=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                              decoder_start_token_id=0, forced_eos_token_id=None))
    mpt = _build(MptForCausalLM, MptConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, use_cache=True,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0))
    for model in (bart, mpt):
        _check_exact(model, batch=1, noise=None)
        for path in ("dynamic", "static"):
            _check_refused_up_front(model, "only batch size 1 is exact", path=path, monkeypatch=monkeypatch)


def test_models_counting_positions_from_cache_slots_are_refused_by_continuous_batching():
    """Continuous batching merges every request into one running batch: a model counting positions from cache
    slots (MPT's ALiBi over key slots) got positions shifted by the other rows' slots and holes, and silently other
    tokens than model.generate on the request alone. add_request now refuses it by name, even the first request."""
    mpt = _build(MptForCausalLM, MptConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, use_cache=True,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0))
    decoder = sk.SpeculativeDecoder(mpt, perturbed(mpt, 0.3), num_speculative_tokens=3)
    with pytest.raises(ValueError, match=r"MptForCausalLM.*ALiBi from key slot indices.*only batch size 1"):
        decoder.add_request(torch.arange(3, 13), max_new_tokens=10, do_sample=False)


def test_multimodal_model_generating_from_text_is_exact():
    """Gemma 3 with its vision tower generating from text."""
    model = gemma3_multimodal()
    for path in ("dynamic", "static"):
        _check_exact(model, batch=2, path=path)


def qwen2_vl():
    """Qwen2-VL (an image-text-to-text class, in no causal-LM mapping): its rotary half-dimension is split into
    temporal/height/width sections (cut to the tiny head); from text alone HF gives the three the same positions."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(SIZES, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2, spatial_merge_size=1)
    model = _build(Qwen2VLForConditionalGeneration, Qwen2VLConfig(text_config=text, vision_config=vision))
    assert model.model.language_model.rotary_emb.mrope_section == [2, 1, 1]
    return model


def gemma3_multimodal():
    """Gemma 3 with its vision tower (text and vision sub-configs; sliding and global layers)."""
    text = Gemma3TextConfig(**SIZES, head_dim=8, sliding_window=6)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    return _build(Gemma3ForConditionalGeneration, Gemma3Config(text_config=text, vision_config=vision))


def test_multimodal_rotary_model_generating_from_text_is_exact():
    model = qwen2_vl()
    for path in ("dynamic", "static"):
        _check_exact(model, batch=2, path=path)


@pytest.mark.parametrize("make", [qwen2_vl, gemma3_multimodal])
def test_multimodal_models_in_continuous_batching(make):
    """Requests joining and leaving a running batch of a multimodal model generating from text: each equals
    model.generate on it alone. add_request read the vocabulary size from the top-level config, which a multimodal
    config keeps in its text config: AttributeError."""
    model = make()
    decoder = sk.SpeculativeDecoder(model, perturbed(model, 0.3), num_speculative_tokens=3)
    prompts = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 4, 9)]
    ids = [decoder.add_request(p, max_new_tokens=10, do_sample=False) for p in prompts[:2]]
    decoder.step()
    ids.append(decoder.add_request(prompts[2], max_new_tokens=10, do_sample=False))
    while any(decoder.result(i).finish_reason is None for i in ids):
        decoder.step()
    for prompt, request in zip(prompts, ids):
        expected = model.generate(prompt[None], max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert decoder.result(request).token_ids == expected[0, len(prompt) :].tolist()


def _llama4_nope(**overrides):
    """Llama 4 text without chunked attention (every layer full attention), its second layer NoPE with attention
    temperature tuning (floor_scale shrunk from 8192 so that the scale steps within a short request)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    settings = dict(intermediate_size_mlp=64, head_dim=8, attention_chunk_size=None, no_rope_layers=[1, 0],
                    floor_scale=4, attn_scale=0.5, num_local_experts=2, interleave_moe_layer_step=1)
    config = Llama4TextConfig(**SIZES, **{**settings, **overrides})
    return _build(Llama4ForCausalLM, config)


def test_queries_scaled_by_the_cache_length_are_exact_at_batch_one_only(monkeypatch):
    """Llama 4's NoPE layers with attention temperature tuning scale queries by cache.get_seq_length() (slots), not
    by position. Released checkpoints chunk their attention (refused), but attention_chunk_size=None made every layer
    full attention and the model was accepted everywhere: in a batch, rejected drafts leave holes, the slot count runs
    ahead of the position, and the padded batch gave other tokens than model.generate, silently (also in continuous
    batching). Batch 1 is exact; batch > 1 and add_request are refused by name; without temperature tuning the batch
    is exact."""
    from speculative_kernels.generation import capabilities

    model = _llama4_nope(initializer_range=0.2)  # larger logits: the scales' effect shows above rounding
    if "chunked_attention" in model.config.layer_types:  # (transformers 5.17-5.23, whose own generate then fails)
        pytest.skip("this transformers builds chunked layers without attention_chunk_size")
    for path in ("dynamic", "static"):
        _check_exact(model, batch=1, path=path)
        _check_refused_up_front(model, r"scales its queries by the cache's length.*only batch size 1",
                                path=path, monkeypatch=monkeypatch)
    decoder = sk.SpeculativeDecoder(model, perturbed(model, 0.3), num_speculative_tokens=3)
    with pytest.raises(ValueError, match="Llama4ForCausalLM.*scales its queries by the cache's length"):
        decoder.add_request(torch.arange(3, 13), max_new_tokens=10, do_sample=False)
    _check_exact(_llama4_nope(attn_temperature_tuning=False), batch=2)
    # BigBird's attention reads its cache length too, for another purpose (whether cross-attention K/V are cached):
    # not refused, exact in a batch
    from transformers import BigBirdConfig, BigBirdForCausalLM

    bigbird = _build(BigBirdForCausalLM, BigBirdConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=2, num_attention_heads=4, is_decoder=True,
                                                        attention_type="original_full", bos_token_id=1,
                                                        eos_token_id=2, pad_token_id=0))
    _check_exact(bigbird, batch=2)
    # what the refusal prevents: other logits in the batch (by ~0.1 of 4; rounding is ~1e-6)
    monkeypatch.setattr(capabilities, "_scales_by_cache_length", lambda model: None)
    ids, mask = _batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    expected = model.generate(ids, **kwargs).logits
    got = sk.generate(model, ids, draft_model=perturbed(model, 0.3), num_speculative_tokens=3, **kwargs).logits
    assert max((a - b).abs().max().item() for a, b in zip(expected, got)) > 1e-2


def test_positions_counted_from_the_input_ids_without_position_ids_are_refused(monkeypatch):
    """TrOCR's decoder with use_learned_position_embeddings=False (as released TrOCR checkpoints set it) numbers
    positions from the input ids with pad ids skipped and takes no position_ids: a pad id inside a forward over
    several tokens shifts every later position, unlike a one-token step. A prompt holding the pad id gave another
    first token than model.generate, silently; a generated pad id, other logits. Refused on every path and batch;
    learned positions (slot-based) stay exact at batch 1."""
    from transformers import TrOCRConfig, TrOCRForCausalLM

    from speculative_kernels.generation import capabilities

    def trocr(learned: bool):
        config = TrOCRConfig(vocab_size=97, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                             decoder_ffn_dim=64, max_position_embeddings=256, init_std=0.2,
                             use_learned_position_embeddings=learned, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             decoder_start_token_id=1)
        return _build(TrOCRForCausalLM, config, seed=2)

    model = trocr(learned=False)
    for path in ("dynamic", "static"):
        for batch in (1, 2):
            _check_refused_up_front(model, "derives positions from the input ids, skipping pad ids", batch=batch,
                                    path=path, monkeypatch=monkeypatch)
    _check_exact(trocr(learned=True), batch=1)
    # what the refusal prevents: a prompt holding the pad id (attention mask 1)
    monkeypatch.setattr(capabilities, "_input_id_positions_reason", lambda model: None)
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    ids[0, 6] = 0
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = sk.generate(model, ids, draft_model=perturbed(model, 0.3), num_speculative_tokens=3, **kwargs)
    assert not torch.equal(got, model.generate(ids, **kwargs))


def test_models_deriving_positions_from_input_ids_are_refused(monkeypatch):
    """Kosmos-2.5's prepare_inputs_for_generation drops position_ids, so in HF's generate its forward numbers the
    positions itself (from padding_idx + 1, pad tokens skipped); ours passed explicit 0-based position ids, which it
    reads as other rows of its sinusoid table: different tokens, silently. Refused up front on every path."""
    try:
        from transformers.models.kosmos2_5.configuration_kosmos2_5 import Kosmos2_5TextConfig
        from transformers.models.kosmos2_5.modeling_kosmos2_5 import Kosmos2_5TextForCausalLM
    except ImportError:
        pytest.skip("this transformers has no Kosmos-2.5")
    from speculative_kernels.generation import capabilities

    config = Kosmos2_5TextConfig(vocab_size=97, embed_dim=32, layers=2, ffn_dim=64, attention_heads=4,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = _build(Kosmos2_5TextForCausalLM, config)
    for path in ("dynamic", "static"):
        for batch in (1, 2):
            _check_refused_up_front(model, r"Kosmos2_5TextForCausalLM\.prepare_inputs_for_generation drops "
                                    "position_ids", batch=batch, path=path, monkeypatch=monkeypatch)
    # what the refusal prevents: driven with explicit position ids, even the model drafting for itself differs
    monkeypatch.setattr(capabilities, "_own_positions_reason", lambda model: None)
    ids, _ = _batch(1)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert not torch.equal(sk.generate(model, ids, draft_model=model, **kwargs), model.generate(ids, **kwargs))


def deepseek_v3_latent(**overrides):
    config = DeepseekV3Config(**{**SIZES, "num_key_value_heads": 4, **overrides}, moe_intermediate_size=32,
                              kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1)
    return _build(DeepseekV3ForCausalLM, config)


@pytest.mark.parametrize("path", ["dynamic", "static", "compile"])
def test_latent_attention_is_exact_on_every_path(path):
    """DeepSeek V3's multi-head latent attention caches its latents (keys [B, 1, C, kv_lora_rank], values
    [B, 1, C, qk_rope_head_dim]; transformers 5.17 and 5.24 alike) and expands them per head after the cache: the
    static cache sizes K and V so (it refused the model before), batch 2 left-padded (holes compacted), batch 1
    compiled (one dense layer: the compile stays short), and rows joining in continuous batching."""
    model = deepseek_v3_latent(num_hidden_layers=1) if path == "compile" else deepseek_v3_latent()
    if path != "dynamic":
        assert set(check_model(model, path=path, batch=1).kv_sizes) == {(1, 16, 8)}
    _check_exact(model, batch=1 if path == "compile" else 2, path=path)
    if path == "static":
        _check_continuous(model)


def test_latent_attention_samples_on_the_static_cache_as_on_the_dynamic_one():
    """Sampling (temperature, top-k) in a left-padded batch: the static cache's tokens are the dynamic cache's, draw
    for draw (whose distribution is model.generate's: test_generate_sampling.py)."""
    model = deepseek_v3_latent()
    draft = perturbed(model, 0.3)
    ids, mask = _batch(2)
    runs = []
    for cache in ("dynamic", "static"):
        torch.manual_seed(7)
        runs.append(sk.generate(model, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                                max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, pad_token_id=0,
                                cache_implementation=cache))
    assert torch.equal(*runs)


def test_latent_attention_caching_other_than_its_latents_is_refused_on_the_static_cache(monkeypatch):
    """An MLA forward that does not cache its latents before expanding them (5.17's sparse-attention models cache the
    expanded K/V; a user's own forward may do anything) is refused up front by name on the static cache."""
    from speculative_kernels.generation import capabilities

    model = deepseek_v3_latent()
    assert capabilities._caches_latents(model)
    monkeypatch.setattr(capabilities, "_caches_latents", lambda model: False)
    _check_refused_up_front(model, "multi-head latent attention.*does not write its latents", path="static",
                            monkeypatch=monkeypatch)


def test_config_without_a_layer_layout_is_refused():
    """BLT keeps its layers in sub-configs (patcher, encoder, global transformer, decoder): nothing states its cache
    layout, so the check refuses it by name instead of failing with an AttributeError. (Built on the meta device:
    the check reads only the config and the forward's signature.)"""
    try:
        from transformers import BltConfig, BltForCausalLM
    except ImportError:
        pytest.skip("this transformers has no BLT")
    with torch.device("meta"):
        model = BltForCausalLM(BltConfig())
    for path in ("dynamic", "static"):
        with pytest.raises(ValueError, match="BltForCausalLM.*states neither layer_types nor num_hidden_layers"):
            check_model(model, path=path, batch=1)


def test_models_with_their_own_generate_are_refused(monkeypatch):
    """MusicGen's generate() adds its codebook delay pattern to HF's loop: speculative_kernels would silently skip it,
    so it refuses the model up front, on every path, naming the override."""
    config = MusicgenDecoderConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   ffn_dim=64, num_codebooks=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = _build(MusicgenForCausalLM, config)
    for path in ("dynamic", "static"):
        for batch in (1, 2):
            _check_refused_up_front(model, r"MusicgenForCausalLM\.generate adds steps of its own", batch=batch,
                                    path=path, monkeypatch=monkeypatch)


def test_assistants_drafting_from_a_targets_internal_states_are_refused_by_what_they_are(monkeypatch):
    """Gemma 4's assistant checkpoints draft from the target's last hidden state and shared K/V
    (transformers' SinglePositionMultiTokenCandidateGenerator), not from token ids. Passed as draft_model (or as a
    model), the refusal says so; it used to call it 'a cache-less or recurrent model'."""
    try:
        from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig
    except ImportError:
        pytest.skip("this transformers has no Gemma 4 assistant")
    text = Gemma4TextConfig(**SIZES, head_dim=8, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                            num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"])
    try:
        assistant = _build(Gemma4AssistantForCausalLM, Gemma4AssistantConfig(
            text_config=text, backbone_hidden_size=32, num_centroids=8, centroid_intermediate_top_k=2))
    except ValueError as error:  # 5.23's kv_sharing_modes refuses a config whose every layer is shared, which an
        # assistant's must be: no Gemma 4 assistant can be built there (from_pretrained neither), nothing to refuse
        pytest.skip(f"this transformers cannot build a Gemma 4 assistant: {error}")
    match = r"drafts from another model's internal states \(its forward takes shared_kv_states\)"
    target = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    ids, mask = _batch(1)
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=f"Gemma4AssistantForCausalLM.*{match}"):
        patch.setattr(request_module, "make_runner", _no_loop)
        patch.setattr(request_module, "SpeculativeLoop", _no_loop)
        sk.generate(target, ids, attention_mask=mask, draft_model=assistant, max_new_tokens=4)
    for path in ("dynamic", "static", "compile"):
        _check_refused_up_front(assistant, match, batch=1, path=path, monkeypatch=monkeypatch)


def _custom_attention(name: str, mask_function=None):
    """A Llama whose attention is sdpa registered under ``name`` (HF's AttentionInterface pattern), with
    ``mask_function`` registered for it too when given."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, lambda *args, **kwargs: sdpa_attention_forward(*args, **kwargs))
    if mask_function is not None:
        AttentionMaskInterface.register(name, mask_function)
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    model.config._attn_implementation = name
    return model


def test_an_attention_without_a_mask_function_is_refused(monkeypatch):
    """transformers builds no mask for an attention implementation without a mask function (a custom one registered
    with AttentionInterface alone, 'paged|eager'): fine for model.generate's one-token steps, but a verification
    forward over several tokens ran unmasked and gave other tokens from the first one, silently."""
    model = _custom_attention("sk_test_unmasked_sdpa")
    for path in ("dynamic", "static"):
        _check_refused_up_front(model, r"attn_implementation='sk_test_unmasked_sdpa' has no mask function", batch=1,
                                path=path, monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match=r"draft_model: LlamaForCausalLM .* has no mask function"):
        sk.generate(_build(LlamaForCausalLM, LlamaConfig(**SIZES)), _batch(1)[0], draft_model=model,
                    max_new_tokens=4)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_an_attention_registered_with_sdpas_mask_function_is_exact(batch, path):
    from transformers.masking_utils import sdpa_mask

    _check_exact(_custom_attention("sk_test_masked_sdpa", sdpa_mask), batch=batch, path=path)


def test_dynamically_quantized_models_are_refused(monkeypatch):
    """quantize_dynamic's activation scale spans every token of a forward, so a verification forward gives other
    logits than one-token steps (other greedy tokens, the target its own draft); it crashed with an AttributeError
    (a quantized Linear's weight is a method) after the runners were built."""
    model = torch.ao.quantization.quantize_dynamic(_build(LlamaForCausalLM, LlamaConfig(**SIZES)),
                                                   {torch.nn.Linear}, dtype=torch.qint8)
    _check_refused_up_front(model, "dynamically quantized modules", batch=1, monkeypatch=monkeypatch)


def test_quantization_aware_training_with_observers_on_is_refused(monkeypatch):
    """prepare_qat's fake-quantize modules observe every forward's activations (in eval mode too) and set their
    scale from them, so a verification forward over several tokens gave other greedy tokens than model.generate's
    one-token steps, silently. With the observers disabled (the scales as trained) the model is refused too:
    rounding activations to the grid turns width-dependent float rounding into whole quantization steps (another top
    token at 1 of 60 prompts, measured); as a draft it runs."""
    from torch.ao.quantization import disable_observer, get_default_qat_qconfig, prepare_qat

    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES)).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.qconfig = get_default_qat_qconfig("fbgemm")
    prepare_qat(model, inplace=True)
    model.eval()
    _check_refused_up_front(model, "fake-quantize modules whose observers are on", monkeypatch=monkeypatch)
    import copy

    draft = copy.deepcopy(model)  # as a draft it is exact: its logits are read as given (HF's assisted runs it too)
    ids, mask = _batch(2)
    expected = _build(LlamaForCausalLM, LlamaConfig(**SIZES)).generate(ids, attention_mask=mask, max_new_tokens=8,
                                                                         do_sample=False, pad_token_id=0)
    got = sk.generate(_build(LlamaForCausalLM, LlamaConfig(**SIZES)), ids, attention_mask=mask, draft_model=draft,
                      num_speculative_tokens=3, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    model.apply(disable_observer)
    _check_refused_up_front(model, r"fake-quantize modules \(.*the scales as trained", monkeypatch=monkeypatch)


def _torchao_like_weight(weight, granularity):
    """A weight shaped as torchao's quantized tensors present themselves to the check (a tensor subclass from a
    torchao module with ``act_quant_kwargs.granularity``), for machines without torchao; the real one is below."""
    subclass = type("Int8Tensor", (torch.Tensor,), {"__module__": "torchao.quantization"})
    parameter = torch.nn.Parameter(weight.detach().as_subclass(subclass), requires_grad=False)
    parameter.act_quant_kwargs = type("Kwargs", (), {"granularity": granularity})()
    return parameter


def test_activation_quantization_is_refused(monkeypatch):
    """torchao's activation quantization rounds a target's activations to a grid: per tensor
    (Float8DynamicActivationFloat8WeightConfig's default, Int8DynamicActivationInt8WeightConfig(granularity=PerTensor()))
    the scale spans a forward's tokens; per row (Int8DynamicActivationInt8WeightConfig's default PerRow(), and
    Int8DynamicActivationIntxWeightConfig's int8_asym_per_token) a value that attention's width-dependent rounding
    puts at a grid boundary moves a whole step: a verification forward gave other greedy tokens than one-token steps
    in 7 of 20 prompts, silently (PerRow was accepted as exact). Weight-only torchao tensors are exact."""
    PerTensor = type("PerTensor", (), {"__repr__": lambda self: "PerTensor()"})
    PerRow = type("PerRow", (), {"dim": -1, "__repr__": lambda self: "PerRow(dim=-1)"})
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    proj = model.model.layers[0].self_attn.q_proj
    original = proj.weight
    proj.weight = _torchao_like_weight(original, PerTensor())
    _check_refused_up_front(model, r"torchao tensors that quantize activations .*q_proj.weight \(PerTensor\(\)\)",
                            monkeypatch=monkeypatch)
    proj.weight = _torchao_like_weight(original, PerRow())
    _check_refused_up_front(model, r"torchao tensors that quantize activations .*q_proj.weight \(PerRow\(dim=-1\)\)",
                            monkeypatch=monkeypatch)
    proj.weight = _torchao_like_weight(original, None)
    del proj.weight.act_quant_kwargs
    proj.weight.activation_quantization = "int8_asym_per_token"  # IntxUnpackedToInt8Tensor's per-token scheme
    _check_refused_up_front(model, r"q_proj.weight \(int8_asym_per_token\)", monkeypatch=monkeypatch)
    proj.weight.activation_quantization = None  # weight-only
    _check_exact(model, batch=2, noise=None)


def test_torchao_activation_quantization_is_refused(monkeypatch):
    """The same with torchao itself (skipped where it is not installed)."""
    pytest.importorskip("torchao")
    from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8DynamicActivationIntxWeightConfig,
                                      Int8WeightOnlyConfig, quantize_)
    from torchao.quantization.granularity import PerTensor

    for config in (Int8DynamicActivationInt8WeightConfig(granularity=PerTensor()),
                   Int8DynamicActivationInt8WeightConfig(), Int8DynamicActivationIntxWeightConfig()):
        model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
        quantize_(model, config)
        _check_refused_up_front(model, "torchao tensors that quantize activations", monkeypatch=monkeypatch)
    draft = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    quantize_(draft, Int8DynamicActivationInt8WeightConfig())  # as a draft it is exact: its logits are read as given
    ids, mask = _batch(2)
    target = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                      max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    quantize_(model, Int8WeightOnlyConfig())
    _check_exact(model, batch=2, noise=None)


def _quanto_like_weight(weight):
    """A weight shaped as optimum-quanto's 2/4-bit tensors present themselves to the check (a subclass of a class
    named WeightQBitsTensor from optimum.quanto), for machines without optimum-quanto; the real one is below."""
    qbits = type("WeightQBitsTensor", (torch.Tensor,), {"__module__": "optimum.quanto.tensor.weights.qbits"})
    subclass = type("TinyGemmWeightQBitsTensor", (qbits,), {"__module__": "optimum.quanto.tensor.weights.tinygemm"})
    return torch.nn.Parameter(weight.detach().as_subclass(subclass), requires_grad=False)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_quanto_four_bit_weights_are_refused(role, monkeypatch):
    """optimum-quanto's 2/4-bit weights (WeightQBitsTensor) fail in every forward under torch.inference_mode, which
    the loop runs in: "Cannot set version_counter for inference tensor" from inside quanto (its issue #304), for a
    target and a draft alike; model.generate runs under no_grad. Refused by name; quanto's int8 weights run."""
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    proj = model.model.layers[0].mlp.down_proj
    proj.weight = _quanto_like_weight(proj.weight)
    float_model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    target, draft = (model, float_model) if role == "target" else (float_model, model)
    ids, mask = _batch(1)
    name = "model" if role == "target" else "draft_model"
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=f"{name}: .*optimum-quanto 2/4-bit tensors "
                                                                         r"\(model.layers.0.mlp.down_proj.weight"):
        patch.setattr(request_module, "make_runner", _no_loop)
        patch.setattr(request_module, "SpeculativeLoop", _no_loop)
        sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3, max_new_tokens=4,
                    pad_token_id=0)


def test_quanto_weights(monkeypatch):
    """The same with optimum-quanto itself (skipped where it is not installed): qint4 refused, qint8 exact."""
    quanto = pytest.importorskip("optimum.quanto")
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    _check_refused_up_front(model, "optimum-quanto 2/4-bit tensors", monkeypatch=monkeypatch)
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    quanto.quantize(model, weights=quanto.qint8)
    quanto.freeze(model)
    _check_exact(model, batch=2, noise=None)
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    quanto.quantize(model, weights=quanto.qint8, activations=quanto.qint8)
    quanto.freeze(model)
    _check_refused_up_front(model, "optimum-quanto modules that quantize activations", monkeypatch=monkeypatch)


def test_quanto_activation_quantization_is_refused(monkeypatch):
    """optimum-quanto's activation quantization (quantize(model, activations=qint8 / qfloat8), QuantoConfig(
    activations=...)) rounds a target's activations to a grid with calibrated scales: width-dependent float rounding
    becomes whole quantization steps (qfloat8: 2.2e-2 at a logit scale of 0.75, measured). Refused by name for a
    target; a module shaped as quanto's (for machines without it; the real one above)."""
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    mixin = type("QModuleMixin", (), {"__module__": "optimum.quanto.nn.qmodule"})
    proj = model.model.layers[0].self_attn.q_proj
    proj.__class__ = type("QLinear", (type(proj), mixin), {"__module__": "optimum.quanto.nn.qlinear"})
    proj.activation_qtype = "qint8"
    _check_refused_up_front(model, r"optimum-quanto modules that quantize activations \(model.layers.0.self_attn."
                                   r"q_proj \(qint8\)", monkeypatch=monkeypatch)


@pytest.mark.parametrize("batch", [1, 2])
def test_imagegpt_is_driven_with_the_two_d_mask(batch, monkeypatch):
    """ImageGPT's forward flattens any mask to [B, -1] (GPT-2 and CTRL guard that line with ndim < 4): the runners'
    4-D mask became a garbled padding mask, and even the target as its own draft gave other tokens than
    model.generate, silently. It now gets the 2-D mask; the static cache (explicit 4-D masks) refuses it by name."""
    from transformers import ImageGPTConfig, ImageGPTForCausalImageModeling

    config = ImageGPTConfig(vocab_size=98, n_positions=64, n_embd=32, n_layer=2, n_head=4, pad_token_id=0,
                            bos_token_id=1, eos_token_id=2)
    model = _build(ImageGPTForCausalImageModeling, config)
    _check_exact(model, batch=batch)
    if batch == 1:
        _check_refused_up_front(model, "flattens any attention mask", path="static", monkeypatch=monkeypatch)


@pytest.mark.parametrize("batch", [1, 2])
def test_blip_text_decoder_alone_is_exact(batch):
    """BLIP's text decoder wraps the cache it is given in an EncoderDecoderCache (its cross-attention side empty
    without encoder states): the first rollback failed with our own TypeError. The runner now keeps the
    self-attention cache it wrapped."""
    from transformers import BlipTextConfig, BlipTextLMHeadModel

    config = BlipTextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, encoder_hidden_size=32, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0, sep_token_id=2)
    _check_exact(_build(BlipTextLMHeadModel, config), batch=batch)


def test_a_class_replacing_a_step_of_the_generation_loop_is_refused_first():
    """Higgs Audio's generation mixin overrides _sample (codebooks from an audio head) but not generate, which was
    all the check read: the model ran as a text LM and returned unrelated ids, silently. Any of GenerationMixin's
    loop methods overridden by a transformers class is now refused, and first: Qwen2.5-Omni's refusal came after
    the prompt's vocabulary check, which failed inside transformers (get_input_embeddings: NotImplementedError)."""
    import transformers
    from transformers.generation.utils import GenerationMixin

    own_sample = type("OwnSampleMixin", (GenerationMixin,), {"_sample": lambda self, *a, **k: None,
                                                            "__module__": "transformers.models.fake.generation"})
    model = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    model.__class__ = type("FakeAudioForConditionalGeneration", (own_sample, LlamaForCausalLM),
                           {"__module__": "transformers.models.fake.modeling"})
    ids, mask = _batch(1)
    with pytest.raises(ValueError, match=r"model: FakeAudioForConditionalGeneration cannot be driven .*"
                                         r"OwnSampleMixin\._sample replaces a step"):
        sk.generate(model, ids, attention_mask=mask, prompt_lookup_num_tokens=2, max_new_tokens=4)
    if hasattr(transformers, "Qwen2_5OmniForConditionalGeneration"):
        class Omni(transformers.Qwen2_5OmniForConditionalGeneration):  # its own generate, no embeddings of its own
            __module__ = "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni"

            def __init__(self):
                torch.nn.Module.__init__(self)
                self.config, self.generation_config = LlamaConfig(**SIZES), transformers.GenerationConfig()

            def get_input_embeddings(self):
                raise NotImplementedError("get_input_embeddings not auto-handled")

            def forward(self, input_ids=None, attention_mask=None, past_key_values=None):
                raise AssertionError("not reached")

        with pytest.raises(ValueError, match=r"model: Omni cannot be driven .*Qwen2_5OmniForConditionalGeneration"
                                             r"\.generate adds steps"):
            sk.generate(Omni(), ids, attention_mask=mask, prompt_lookup_num_tokens=2, max_new_tokens=4)


def test_a_forward_wrapped_without_functools_wraps_is_driven_by_the_class_signature():
    """model.forward = lambda *a, **k: original(*a, **k) (a logging wrapper) hides the keywords; it was refused as
    'a cache-less or recurrent model'. HF's generate runs it; so does this, through the class's forward keywords."""
    target = _build(LlamaForCausalLM, LlamaConfig(**SIZES))
    original = target.forward
    target.forward = lambda *args, **kwargs: original(*args, **kwargs)
    _check_exact(target, batch=2, noise=None)  # (a perturbed copy would keep the lambda, calling the target)


def test_encoder_family_without_is_decoder_is_refused(monkeypatch):
    config = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    _check_refused_up_front(_build(BertLMHeadModel, config), "is_decoder is False", monkeypatch=monkeypatch)
    config.is_decoder = True
    _check_exact(_build(BertLMHeadModel, config), batch=2)


# ------------------------------------------------------------------------------------------- recurrent state
def lfm2():  # the case of issue 12: silently different in a padded batch before
    return _build(Lfm2ForCausalLM, Lfm2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              layer_types=["conv", "full_attention"], bos_token_id=1,
                                              eos_token_id=2, pad_token_id=0))


RECURRENT = {
    "lfm2": (lfm2, r"\['conv'\] layers"),
    # transformers <= 5.23: the forward takes cache_params, not past_key_values; 5.24 renamed both to cache, and
    # the cache layout names the layers
    "mamba": (lambda: _build(MambaForCausalLM, MambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2)),
              r"takes no past_key_values|\['linear_attention'\] layers"),
    "falcon_mamba": (lambda: _build(FalconMambaForCausalLM, FalconMambaConfig(vocab_size=97, hidden_size=32,
                                                                              num_hidden_layers=2)),
                     r"takes no past_key_values|\['linear_attention'\] layers"),
    "rwkv": (lambda: _build(RwkvForCausalLM, RwkvConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                                        attention_hidden_size=32, intermediate_size=64)),
             "takes no past_key_values|recurrent"),
    "recurrent_gemma": (lambda: _build(RecurrentGemmaForCausalLM, RecurrentGemmaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, lru_width=32, head_dim=8, attention_window_size=8, pad_token_id=0)),
        "takes no past_key_values|recurrent"),
    "openai_gpt": (lambda: _build(OpenAIGPTLMHeadModel, OpenAIGPTConfig(vocab_size=97, n_embd=32, n_layer=2,
                                                                        n_head=4)),
                   "takes no past_key_values"),
}


@pytest.mark.parametrize("name", sorted(RECURRENT))
@pytest.mark.parametrize("path", ["dynamic", "static", "compile"])
def test_recurrent_and_cacheless_models_are_refused_up_front_on_every_path(name, path, monkeypatch):
    make, match = RECURRENT[name]
    _check_refused_up_front(make(), match, batch=1 if path == "compile" else 2, path=path, monkeypatch=monkeypatch)


def test_sliding_windows_with_masked_tokens_inside_a_prompt_are_refused(monkeypatch):
    """A prompt mask with a zero after the first real token (a pad_token_id inside a prompt is masked so, as in HF):
    HF's sliding window counts cache slots, the masked one included, ours real positions, so a window reaching
    across the hole covered one key more than HF's (silently other tokens; found by the differential harness on
    Gemma 3). Refused by name where a window can reach across (generate and add_request); exact where it cannot."""
    from speculative_kernels.generation import request

    target = gemma2_window()
    draft = perturbed(target, 0.3)
    ids = torch.tensor([[60, 26, 3, 18, 86, 47, 91, 55, 12, 13]])
    mask = torch.ones_like(ids)
    mask[0, 2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match=r"masks tokens after the first real one in rows \[0\].*window 6"):
        sk.generate(target, ids, draft_model=draft, **kwargs)
    short = dict(kwargs, attention_mask=mask[:, :4], max_new_tokens=3)  # forwards span 5 slots: one window
    assert torch.equal(sk.generate(target, ids[:, :4], draft_model=draft, **short),
                       target.generate(ids[:, :4], **short))
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="inferred from pad_token_id masks tokens after the first real one"):
        decoder.add_request([60, 26, 0, 18, 86, 47, 91, 55, 12, 13], max_new_tokens=12)
    monkeypatch.setattr(request, "check_window_holes", lambda *args, **kwargs: None)  # what the refusal prevents
    assert not torch.equal(sk.generate(target, ids, draft_model=draft, **kwargs), target.generate(ids, **kwargs))


def _causal(model) -> bool:
    """Whether the first position's logits are independent of the second token (they are in a causal model)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6], [5, 7]]), use_cache=False).logits
    return torch.equal(logits[0, 0], logits[1, 0])


@pytest.mark.parametrize("make", [
    lambda: _build(MegatronBertForCausalLM, MegatronBertConfig(**SIZES, is_decoder=True)),
    lambda: _build(RemBertForCausalLM, RemBertConfig(**{**SIZES, "input_embedding_size": 32,
                                                        "output_embedding_size": 32}, is_decoder=True)),
    lambda: _build(RoFormerForCausalLM, RoFormerConfig(**SIZES, is_decoder=True)),
])
def test_decoders_with_a_bidirectional_mask_are_refused(make, monkeypatch):
    """transformers 5.17 (the GPU image's, CI's second job) builds these BERT-family decoders' self-attention mask
    with create_bidirectional_mask alone: model.generate encodes the prompt bidirectionally then steps one token
    at a time, so a multi-token verification forward (drafts seeing later drafts) differed silently (MegatronBert:
    other tokens on every path). Refused by name where the installed transformers does that; exact where it does
    not (later versions)."""
    model = make()
    if _causal(model):
        _check_exact(model, batch=1, noise=None, new=16)
    else:
        _check_refused_up_front(model, "bidirectional self-attention mask", batch=1, monkeypatch=monkeypatch)


@pytest.mark.parametrize("make", [
    lambda: _build(Gemma2ForCausalLM, Gemma2Config(**SIZES, head_dim=8, use_bidirectional_attention=True)),
    lambda: _build(Gemma3ForConditionalGeneration, Gemma3Config(
        text_config=Gemma3TextConfig(**SIZES, head_dim=8, use_bidirectional_attention=True),
        vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14), mm_tokens_per_image=4,
        image_token_index=96, boi_token_index=94, eoi_token_index=95)),
], ids=["gemma2", "gemma3"])
def test_prefix_lms_are_refused(make, monkeypatch):
    """use_bidirectional_attention=True (PaliGemma's text config's default; Gemma 3's for embeddings): model.generate's
    prefill lets the prompt attend bidirectionally (the first token's logits are not a causal forward's), which the
    causal speculative forwards are not; before, the output differed silently (the architecture sweep's PaliGemma
    row: logits off by 7e-4 of their scale, rounding being 1e-7). Refused by name on every path."""
    model = make()
    ids = _batch(1)[0]
    with torch.no_grad():
        first = model.generate(ids, max_new_tokens=1, do_sample=False, output_logits=True,
                               return_dict_in_generate=True).logits[0][0]
        causal = model(ids, attention_mask=torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).tril())
    assert (first - causal.logits[0, -1]).abs().max() > 1e-4 * first.abs().max()  # (float rounding: ~1e-7)
    for path in PATHS:
        _check_refused_up_front(model, "use_bidirectional_attention=True", batch=1, path=path, monkeypatch=monkeypatch)


def test_git_is_exact_or_refused_by_name(monkeypatch):
    """GIT in transformers 5.17 widens a 2-D mask at one-token steps (``seq_len == 1``), whatever mask it gets: our
    4-D masks crashed inside transformers (torch.cat of a 2-D and a 4-D tensor). Refused by name there. From 5.18 it
    widens only 2-D masks, by the image tokens, which a text-only cache does not hold: model.generate's steps attend
    to a padded row's padding, ours did not, so a left-padded batch is refused by name (``attention_mask masks
    slots``) and batch 1 is exact. The padded batch runs in every version: the source rule once matched only 5.24's
    one-line condition, and 5.18-5.23 gave other tokens than model.generate with no error."""
    from transformers import GitConfig, GitForCausalLM

    from speculative_kernels.generation.capabilities import _two_d_mask_reason

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8)

    def git(**extra):
        return _build(GitForCausalLM, GitConfig(vision_config=vision, vocab_size=97, hidden_size=32,
                                                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra))

    model = git()
    if _two_d_mask_reason(model) is not None:
        _check_refused_up_front(model, "widens a 2-D attention mask", batch=1, monkeypatch=monkeypatch)
        return
    _check_exact(model, batch=1, noise=None, new=16)
    # weights large enough that attending to the padding changes the tokens, not just the logits (by ~3e-3 at
    # the default initializer range; rounding is ~1e-7)
    padded = git(initializer_range=0.2)
    ids, mask = _batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    if check_model(padded, batch=2).masked_slots_exact:  # (a transformers that stops widening: exact)
        got = sk.generate(padded, ids, draft_model=padded, num_speculative_tokens=3, **kwargs)
        assert torch.equal(got, padded.generate(ids, **kwargs))
        return
    with pytest.raises(ValueError, match="attention_mask masks slots .* GitForCausalLM"):
        sk.generate(padded, ids, draft_model=padded, num_speculative_tokens=3, **kwargs)
    decoder = sk.SpeculativeDecoder(padded, padded, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="attention_mask masks slots"):
        decoder.start(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)


def _dory(mode: str):
    import transformers

    if not hasattr(transformers, "DoryConfig"):
        pytest.skip("Dory arrived in transformers 5.24")
    config = transformers.DoryConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, num_hidden_layers=4, n_input_layers=1,
                                     n_recurrent_layers=2, n_output_layers=1, sliding_window=6,
                                     layer_types=["sliding_attention", "full_attention"] * 2,
                                     recurrent_kv_cache_mode=mode, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _build(transformers.DoryForCausalLM, config)


@pytest.mark.parametrize("batch", [1, 2])
def test_dory_recurrent_loops_exact_on_the_dynamic_cache(batch):
    """Dory runs its middle layers in loops, appending a copy of their cache layers per loop: the dynamic cache
    rolls every appended layer back with the others."""
    _check_exact(_dory("per_loop"), batch=batch)


@pytest.mark.parametrize("path", ["static", "compile"])
def test_dory_recurrent_loops_refused_on_the_static_cache(path, monkeypatch):
    """Its forward appended deep copies of the static cache's layers, each with a write pointer of its own that
    the rollback never moved: other tokens than model.generate, silently (found by the 5.24 architecture sweep)."""
    _check_refused_up_front(_dory("per_loop"), "adds layers of its own to the cache", batch=1, path=path,
                            monkeypatch=monkeypatch)


def test_dory_last_loop_cache_refused(monkeypatch):
    """recurrent_kv_cache_mode='last_loop': earlier loops read the cache's K/V directly and cut the sliding window by
    slot count; it crashed inside the model on every path (the runners' masks cover every slot)."""
    _check_refused_up_front(_dory("last_loop"), "last_loop", batch=2, monkeypatch=monkeypatch)


def _qwen3_omni_thinker(sliding_window):
    """Qwen3-Omni's thinker (MoE text model with multimodal rotary positions), generating from text. Its attention
    modules set ``sliding_window = None`` whatever the config says."""
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig, Qwen3OmniMoeTextConfig, Qwen3OmniMoeVisionEncoderConfig)

    text = Qwen3OmniMoeTextConfig(**SIZES, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                  sliding_window=sliding_window,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 1, 1]})
    vision = Qwen3OmniMoeVisionEncoderConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                             out_hidden_size=32, deepstack_visual_indexes=[0])
    audio = Qwen3OmniMoeAudioEncoderConfig(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                                           output_dim=32, num_mel_bins=8, downsample_hidden_size=8)
    config = Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=vision, audio_config=audio, audio_token_id=93,
                                       image_token_id=94, video_token_id=95, vision_start_token_id=96)
    return _build(Qwen3OmniMoeThinkerForConditionalGeneration, config)



def _llama_with_a_stray_window(window: int = 6):
    """A Llama whose config.json carries a sliding_window (as some converted checkpoints do): HF's cache keeps the
    window, Llama's attention applies none."""
    config = LlamaConfig(**SIZES, tie_word_embeddings=False)
    config.sliding_window = window
    return _build(LlamaForCausalLM, config)


WINDOW_IGNORED = {"llama": _llama_with_a_stray_window, "qwen3-omni thinker": lambda: _qwen3_omni_thinker(6)}


@pytest.mark.parametrize("make", WINDOW_IGNORED.values(), ids=WINDOW_IGNORED.keys())
@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_cache_window_the_attention_does_not_apply_is_refused_past_it(make, path, monkeypatch):
    """A config.sliding_window that HF's cache keeps but the attention ignores (a Llama or Moshi config carrying
    one; Qwen3-Omni's thinker, whose attention modules set sliding_window=None): model.generate attends to the whole
    prompt at prefill and to the last window slots after it. Requests that pass the window gave other tokens than
    model.generate, silently, on every path; they are refused by name before anything runs."""
    model = make()
    ids, mask = _batch(1)
    with monkeypatch.context() as patch, pytest.raises(
            ValueError, match=f"{type(model).__name__}'s config sets sliding_window=6, which HF's cache keeps"):
        patch.setattr(request_module, "make_runner", _no_loop)
        sk.generate(model, ids, attention_mask=mask, draft_model=model, num_speculative_tokens=3, max_new_tokens=4,
                    pad_token_id=0, **PATHS[path])


def test_cache_window_the_attention_does_not_apply_is_exact_within_it():
    """Requests the window spans (prompt + max_new_tokens - 1 <= window) never reach the difference: exact."""
    target = _llama_with_a_stray_window(window=6)
    draft = perturbed(target, 0.3)
    for length, new in [(3, 4), (6, 1), (2, 5)]:
        ids = torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(length))
        expected = target.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=new,
                          do_sample=False, pad_token_id=0)
        assert torch.equal(got, expected)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="sliding_window=6, which HF's cache keeps"):
        decoder.add_request([5, 6, 7], max_new_tokens=5)
    # two requests each within the window, joined: the batch's widest prompt plus the most new tokens would not be
    prompts = {decoder.add_request([5, 6, 7, 8, 9, 10], max_new_tokens=1): [5, 6, 7, 8, 9, 10],
               decoder.add_request([5, 6], max_new_tokens=5): [5, 6]}
    while decoder.has_work():
        decoder.step()
    for request, prompt in prompts.items():
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=len(decoder.result(request).token_ids),
                                do_sample=False)
        assert decoder.result(request).token_ids == alone[0, len(prompt):].tolist()


def test_qwen3_omni_thinker_without_a_window_is_exact():
    """What its released checkpoints configure (sliding_window None): exact, in a left-padded batch."""
    _check_exact(_qwen3_omni_thinker(sliding_window=None), batch=2)


def test_gpt_neo_local_layers_are_exact_at_batch_1_on_the_dynamic_cache_and_refused_elsewhere(monkeypatch):
    """GPT-Neo's "local" layers (every other layer of EleutherAI's checkpoints, window_size 256) apply their window
    through a causal buffer indexed by cache slot, which HF's layer_types does not describe: past the window, holes
    of rejected drafts (a batch) and the static cache's slot layout gave other logits and tokens, silently. Batch 1
    on the dynamic cache (no holes: a rollback cuts the cache) is exact past the window; the rest is refused."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    model = _build(GPTNeoForCausalLM, GPTNeoConfig(
        vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    _check_exact(model, batch=1, new=16)  # 10 + 16 tokens: past the window of 8
    for path in PATHS:
        _check_refused_up_front(model, "window_size=8 over cache slots", batch=2, path=path, monkeypatch=monkeypatch)
    for path in ("static", "compile"):
        _check_refused_up_front(model, "window_size=8 over cache slots", batch=1, path=path, monkeypatch=monkeypatch)


def test_flaubert_which_appends_a_mask_token_to_every_step_is_refused(monkeypatch):
    """Flaubert's prepare_inputs_for_generation appends a mask token to every step's ids (as XLM's, refused for
    dropping position_ids, and XLNet's): it failed with an AssertionError inside transformers."""
    from transformers import FlaubertConfig, FlaubertWithLMHeadModel

    config = FlaubertConfig(vocab_size=97, emb_dim=32, n_layers=2, n_heads=4, causal=True, pad_index=0,
                            bos_index=1, eos_index=2, mask_token_id=3)
    _check_refused_up_front(_build(FlaubertWithLMHeadModel, config), "appends a token of its own",
                            monkeypatch=monkeypatch)


def test_the_git_mask_widening_rule_matches_every_source_form():
    """The rule reads GIT's source: 5.24 states the condition on one line, 5.18-5.23 in parentheses over several
    (which the rule once missed: silently other tokens there, while CI's main transformers matched). Both forms,
    as released, must match; a 2-D check that does not widen the mask, or a 4-D one, must not."""
    from speculative_kernels.generation.capabilities import _WIDENS_2D_MASK_OVER_CACHE as rule

    widen = ("            extended_attention_mask = torch.ones((attention_mask.shape[0], 4))\n"
             "            attention_mask = torch.cat([extended_attention_mask, attention_mask], dim=-1)\n")
    one_line = ("        elif cache is not None and cache_length > 0 and attention_mask is not None and "
                "attention_mask.ndim == 2:\n" + widen)
    parenthesised = ("        elif (\n            past_key_values is not None\n            and past_key_values_length > 0\n"
                     "            and attention_mask is not None\n            and attention_mask.ndim == 2\n"
                     "        ):\n" + widen)
    assert rule.search(one_line) and rule.search(parenthesised)
    assert not rule.search(one_line.replace("ndim == 2", "ndim == 4"))
    assert not rule.search("        if attention_mask.ndim == 2:\n            mask = attention_mask[:, None, None, :]\n")


def test_a_hole_is_refused_once_the_forwards_span_one_slot_more_than_the_window():
    """Prompt 4 + 4 new tokens: forwards span 7 slots, the farthest key at distance 6 = the window, which HF's
    window (in slots) drops and ours (in real positions, across the hole) keeps: refused (seed 2 gave another last
    token when it ran). One new token fewer spans 6 slots, inside the window: exact."""
    target = gemma2_window()
    draft = perturbed(target, 0.3)
    ids = torch.randint(3, 97, (1, 4), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, 2] = 0
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    with pytest.raises(ValueError, match="masks tokens after the first real one"):
        sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=4, **kwargs)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=3, **kwargs),
                       target.generate(ids, max_new_tokens=3, **kwargs))
