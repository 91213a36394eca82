"""Tiny random-weight configs for every causal-LM and seq2seq config class of the installed transformers.

``tiny_config(model_type)`` returns a config with the standard size fields shrunk (vocab 128, hidden 32, 2 layers,
4 heads, 2 KV heads), sub-configs (text, vision, audio, ...) shrunk the same way, or raises ``NotChecked`` with the
reason a generic construction does not work (a sub-config of any model type, sizes a config rejects, ...). Used by
``benchmarks/coverage.py`` and the architecture tests.
"""

import copy
import inspect

import torch
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

VOCAB = 128
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)

# Standard names (config.attribute_map maps most per-family names to these) and a few common per-family ones.
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, n_positions=256, d_model=32, d_ff=64,
    d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    ffn_dim=64, n_inner=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1,
    rotary_dim=8, partial_rotary_factor=0.5, rope_scaling=None, tie_word_embeddings=False,
    initializer_range=0.02,
)


def _fix_dbrx(config) -> None:
    config.attn_config.rope_theta = 10000.0  # read by the attention, absent from the sub-config's defaults
    config.attn_config.clip_qkv = 8.0  # the default None reaches torch.clamp(min=None, max=None), which raises


def _fix_dory(config) -> None:
    # the section sizes default to 8 input and 8 output layers, more than a tiny model has: one input layer, two
    # recurrent ones (looped twice, a cache per loop), one output layer, sliding and full attention alternating
    config.num_hidden_layers, config.n_input_layers, config.n_recurrent_layers, config.n_output_layers = 4, 1, 2, 1
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    config.rope_parameters = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in set(config.layer_types)}


def _fix_omni_thinker(config) -> None:
    # get_rope_index reads vision_start_token_id, which the config class does not define (the released
    # checkpoints' config.json sets it): an id the prompts never hold (they draw from 3..119)
    config.vision_start_token_id = VOCAB - 1


def _fix_qwen3_omni_thinker(config) -> None:
    _fix_omni_thinker(config)
    # its attention modules apply no window whatever the config says, and its released checkpoints set none; the
    # generic sliding_window=6 would make HF's cache keep a window its attention ignores (refused by name; tested
    # in tests/generation/test_architectures.py)
    config.text_config.sliding_window = None


def _fix_cohere_compass_text(config) -> None:
    # rope parameters per layer type (the default {} builds no rotary embedding); sliding and full layers
    config.layer_types = ["sliding_attention", "full_attention"]
    config.rope_parameters = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in config.layer_types}


# Chameleon's checkpoints name their image (VQ-GAN) tokens "IMGIMG<code in letters A-J>Z" in the vocabulary; its
# forward sets those logits to the float minimum. Seven of them at the top of the tiny vocabulary (the sweep's
# prompts use ids below 120), and the "<image>" placeholder.
_CHAMELEON_VOCABULARY = {"<image>": 127, **{f"IMGIMG{chr(ord('A') + i)}Z": 120 + i for i in range(7)}}


# Defaults of the installed transformers that its own modeling code cannot build or run, set as the released
# checkpoints set them (model type -> fix applied to the tiny config).
def _fix_wrapped_decoder(config) -> None:
    """A generic wrapper's decoder as from_encoder_decoder_pretrained (and from_encoder_decoder_configs) sets it: causal
    with cross-attention (the default EncoderDecoderConfig leaves a BERT decoder bidirectional, which is refused)."""
    config.decoder.is_decoder, config.decoder.add_cross_attention = True, True


FIXES = {
    "encoder-decoder": _fix_wrapped_decoder,
    "vision-encoder-decoder": _fix_wrapped_decoder,
    "cohere_compass": lambda config: _fix_cohere_compass_text(config.text_config),
    "cohere_compass_text": _fix_cohere_compass_text,
    "qwen2_5_omni_thinker": _fix_omni_thinker,
    "qwen3_omni_moe_thinker": _fix_qwen3_omni_thinker,
    "xmod": lambda config: setattr(config, "default_language", "en_XX"),  # generate refuses an unset language
    "dbrx": _fix_dbrx,
    "dory": _fix_dory,
    "dots1": lambda config: setattr(config, "n_shared_experts", 1),  # None: the shared expert's size is None * int
    "lfm2_moe": lambda config: setattr(config, "layer_types", ["conv", "full_attention"]),  # None: not a list
    # gated DeltaNet and full attention alternating (two linear layers would leave model.generate no attention
    # layer to read the cache length from: it fails)
    "qwen3_next": lambda config: setattr(config, "layer_types", ["linear_attention", "full_attention"]),
    "qwen3_5_text": lambda config: setattr(config, "layer_types", ["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": lambda config: setattr(config, "layer_types", ["linear_attention", "full_attention"]),
    "qwen3_5": lambda config: setattr(config.text_config, "layer_types", ["linear_attention", "full_attention"]),
    "qwen3_5_moe": lambda config: setattr(config.text_config, "layer_types", ["linear_attention", "full_attention"]),
    "reformer": lambda config: setattr(config, "axial_pos_embds_dim", [16, 16]),  # must sum to the hidden size
    "chameleon": lambda config: setattr(config, "vocabulary_map", _CHAMELEON_VOCABULARY),  # None: no .get
    # timm vision towers (stubbed where timm is missing) whose width the projector reads from the timm config
    "fast_vlm": lambda config: setattr(config.vision_config, "hidden_size", 32),
    "perception_lm": lambda config: setattr(config.vision_config, "model_args", {"embed_dim": 32}),
    # its Q-Former has vision hidden size // 64 heads (18 in the checkpoints; 0 at the tiny size)
    "granite4_vision": lambda config: setattr(config.qformer_config, "num_attention_heads", 1),
}


# Causal-LM classes whose model type names a composite config: the class is built from one of its sub-configs
# (MusicgenForCausalLM from MusicgenConfig.decoder), as their checkpoints' causal-LM folders are.
CAUSAL_SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}


# Per config class, sizes that its validators tie to the generic ones (set as the released checkpoints relate them).
CLASS_SIZES = {
    "Ernie4_5_VLMoeTextConfig": dict(  # one expert size per modality; rotary sections (h, w, t) summing to head_dim / 2, h = w
        moe_intermediate_size=[32, 32],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
    "WavTokenizerEncoderConfig": dict(codebook_dim=32, codebook_size=2),  # no projection around the quantizer
    # Apertus 1.5's image and audio codebooks sit at the top of the vocabulary, one after the other
    "Apertus1p5VisionTokenizerConfig": dict(codebook_size=4),
    "Apertus1p5Config": dict(image_token_id=120, audio_token_id=121, image_token_offset=122, audio_token_offset=126),
    "GraniteDoclingVisionConfig": dict(out_hidden_size=32),  # projects into the text model's hidden size
    "Molmo2AdapterConfig": dict(vision_feature_layer=[-1, -2]),  # indexes the vision tower's layers
    "DeepseekOcr2TextConfig": dict(mlp_layer_types=["dense", "sparse"]),  # None: not indexable (checkpoints list one)
    # vision layer -> text layer injections, the Q-Former's window rate, the four spatial groups' text layers
    "Granite4VisionConfig": dict(deepstack_layer_map=[[-1, 0]], downsample_rate="1/2",
                                 spatial_target_layers=[0, 1, 0, 1]),
    "Gemma4AssistantConfig": dict(backbone_hidden_size=32, num_centroids=8, centroid_intermediate_top_k=2),
    # Mamba2 heads: num_heads * head_dim = expand * hidden_size (the mixer's inner width)
    "Mamba2Config": dict(num_heads=4, head_dim=16, expand=2, n_groups=1, state_size=8, chunk_size=4),
    "BambaConfig": dict(mamba_n_heads=4, mamba_d_head=16, mamba_expand=2, mamba_n_groups=1, mamba_d_state=8,
                        mamba_chunk_size=4, attn_layer_indices=[1]),
    "GraniteMoeHybridConfig": dict(mamba_n_heads=4, mamba_d_head=16, mamba_expand=2, mamba_n_groups=1,
                                   mamba_d_state=8, mamba_chunk_size=4, layer_types=["mamba", "attention"]),
    "Zamba2Config": dict(mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, chunk_size=4, attention_head_dim=8,
                         layers_block_type=["mamba", "hybrid"]),
    "Cosmos3EdgeTextConfig": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 1, 1]}),  # sums to head_dim / 2
}


# Composite configs whose sub-config may be any model type and whose defaults do not build: (sub-config, its model
# type as the checkpoints set it, sizes their validators require, a fix applied to the built sub-config).
# Gemma 4's assistant: a Gemma 4 text stack without per-layer inputs, every layer reading the target's shared K/V.
ANY_TYPE_SUB_CONFIGS = {
    "Gemma4AssistantConfig": ("text_config", "gemma4_text",
                              dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
                              lambda text: setattr(text, "num_kv_shared_layers", text.num_hidden_layers)),
}


class NotChecked(Exception):
    """A config that the generic construction cannot make tiny; the message says why."""


def _fields(config_class) -> set:
    names = set(inspect.signature(config_class.__init__).parameters)
    names |= set(getattr(config_class, "__dataclass_fields__", {}) or {})
    names |= set(getattr(config_class, "attribute_map", {}) or {})
    return names


def tiny_config(model_type: str, **overrides):
    config_class = CONFIG_MAPPING[model_type]
    config = _tiny(config_class, overrides)
    if model_type in FIXES:
        FIXES[model_type](config)
    if getattr(config, "is_encoder_decoder", False):
        config.decoder_start_token_id = 0
    config.use_cache = True  # some configs (MPT) default to False, which generate refuses
    if not getattr(config, "is_encoder_decoder", False):
        config.is_decoder = True  # encoder families (BERT, RoBERTa, ...) generate as decoders only with it
    return config


def _tiny(config_class, overrides: dict):
    """config_class with the standard sizes shrunk; each sub-config (text, vision, audio, encoder, ...) is shrunk
    the same way and passed in as an instance."""
    subs, default = {}, None
    for name, sub_class in sorted((getattr(config_class, "sub_configs", None) or {}).items()):
        sub_name, sub_type, sub_sizes, sub_fix = ANY_TYPE_SUB_CONFIGS.get(config_class.__name__, (None,) * 4)
        if name == sub_name:
            subs[name] = _tiny(CONFIG_MAPPING[sub_type], {**overrides, **sub_sizes})
            sub_fix(subs[name])
            continue
        if sub_class is AutoConfig or not inspect.isclass(sub_class):  # any model type: the default's own class
            try:
                default = default or config_class()
            except Exception as error:  # noqa: BLE001 -- the reason goes into the table
                raise NotChecked(f"nested config whose {name} is any model type and whose defaults do not build: "
                                 f"{type(error).__name__}") from None
            sub_class = type(getattr(default, name, None))
            if not hasattr(sub_class, "sub_configs") and not hasattr(sub_class, "model_type"):
                raise NotChecked(f"nested config whose {name} is any model type and has no default")
        subs[name] = _tiny(sub_class, overrides)
    fields = _fields(config_class)
    kwargs = {k: v for k, v in {**SIZES, **SPECIAL}.items() if k in fields}
    kwargs.update({k: v for k, v in overrides.items() if k in fields})
    if "kv_lora_rank" in fields or "attention_types" in fields:  # MLA / GPT-Neo: per-family head sizes
        kwargs.pop("partial_rotary_factor", None)
        kwargs.pop("head_dim", None)
    if "kv_lora_rank" in fields and "num_key_value_heads" in kwargs:  # MLA expands its latent K/V to every head
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if "kv_lora_rank" in fields and "head_dim" in fields:  # (LongCat's rotary size follows head_dim)
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    if "num_kv_shared_layers" in fields:  # Gemma 3n: the last layer reads the K/V of an earlier one
        kwargs["num_kv_shared_layers"] = 1
    if "attention_types" in fields:
        kwargs["attention_types"] = [[["global", "local"], 1]]
    kwargs.update(CLASS_SIZES.get(config_class.__name__, {}))
    kwargs.update({k: v for k, v in subs.items() if k in fields})
    try:
        config = config_class(**kwargs)
    except Exception as error:  # noqa: BLE001 -- the reason goes into the table
        raise NotChecked(f"{config_class.__name__} rejects the generic tiny sizes: "
                         f"{type(error).__name__}: {str(error).splitlines()[0][:150]}") from None
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    if kwargs.get("num_kv_shared_layers") and len(kinds) > 1:
        # Gemma 4: the shared last layer reads the last earlier layer of its own kind, so every kind must be
        # produced before it: one layer of each kind, then the shared one (given to the constructor, which derives
        # the per-layer configs from it)
        kwargs.update(num_hidden_layers=len(kinds) + 1, layer_types=[*kinds, kinds[-1]])
        config = config_class(**kwargs)
    _fit_layer_lists(config)
    _fit_mrope_sections(config)
    return config


def _fit_mrope_sections(config) -> None:
    """Multimodal rotary embeddings (Qwen2-VL, GLM-4V, ...) split the rotary half-dimension into temporal, height
    and width sections whose default sizes (``[16, 24, 24]``) sum to the default head's: cut them to the tiny
    head's (the modeling code reads ``rope_parameters["mrope_section"]``, falling back to its own default)."""
    import importlib

    parameters = getattr(config, "rope_parameters", None)
    if not isinstance(parameters, dict) or not parameters or "mrope_section" in parameters:
        return  # (an empty dict: no rotary embedding to fit; Cohere Compass's text model)
    try:
        modeling = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        uses_sections = "mrope_section" in inspect.getsource(modeling)
    except (ImportError, OSError, TypeError):
        return
    if not uses_sections:
        return
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not head_dim:
        return
    factor = parameters.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    half = int(head_dim * factor) // 2
    config.rope_parameters = {**parameters, "mrope_section": [half // 3 + (i < half % 3) for i in range(3)]}


def _fit_layer_lists(config) -> None:
    """Per-layer lists (layer_types, ...) sized for the default depth are cut to the tiny depth, keeping one
    layer of each kind where the pattern allows."""
    layers = getattr(config, "num_hidden_layers", None)
    for name in ("layer_types", "layers_block_type", "hybrid_override_pattern", "block_types"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and layers and len(value) != layers:
            kinds = list(dict.fromkeys(value))
            fitted = (kinds * layers)[:layers] if len(kinds) <= layers else list(value[:layers])
            try:
                setattr(config, name, fitted)
            except Exception:  # noqa: BLE001
                pass
