"""HF's generic encoder-decoder wrappers (``EncoderDecoderModel``, ``VisionEncoderDecoderModel``,
``SpeechEncoderDecoderModel``): any encoder with a causal-LM decoder that cross-attends to it. What the runners need
to drive one exactly depends on the wrapped decoder, not on the wrapper:

* how the decoder knows positions under ``model.generate`` (the wrapper's forward takes no position ids, so HF's
  steps leave them to the decoder): BERT-like decoders (BERT, BertGeneration, ELECTRA, ERNIE, RemBERT) and GPT-2
  number them from the cache length, which the runners reproduce by passing each row's true positions as
  ``decoder_position_ids`` (the wrappers hand ``decoder_``-prefixed keywords to the decoder); the RoBERTa family
  numbers them from its pad id, skipping pad tokens, as M2M100 does, which the same keyword reproduces
  (``padding_idx + 1 + position``, ``padding_idx`` at a pad token); TrOCR's decoder and the BART family's
  ``...ForCausalLM`` take none: their learned table (or TrOCR's sinusoids, numbered from the pad id) is read at
  each row's true positions through the forward hooks BART's (M2M100's) table gets;
* which input the encoder takes: token ids, ``pixel_values`` (vision) or ``input_values`` / ``input_features``
  (speech), and, for speech, that the wrapper itself turns the input's attention mask into the cross-attention mask
  (``_get_feature_vector_attention_mask``), so the runners pass it the input's mask as given.

Other wrapped decoders are refused by name (``wrapped_position_kind``), as is a BERT-like decoder whose config says
``is_decoder=False`` (bidirectional, cache-less). Tests: ``tests/generation/test_seq2seq_wrappers.py``.
"""

import torch

WRAPPER_TYPES = ("encoder-decoder", "vision-encoder-decoder", "speech-encoder-decoder")
# wrapped decoder model_type -> its ``capabilities.POSITION_KINDS`` value inside a wrapper (reviewed in transformers
# 5.17 and 5.24); "trocr": "absolute" with use_learned_position_embeddings, else "absolute_skipping_pads"
# ("absolute": the BART family's ...ForCausalLM decoders, whose tables the same hooks read as in the full models)
WRAPPED_DECODER_POSITIONS = {
    **dict.fromkeys(("bert", "bert-generation", "electra", "ernie", "rembert", "gpt2", "gpt-sw3"), "position_ids"),
    **dict.fromkeys(("roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "roberta-prelayernorm"),
                    "position_ids_skipping_pads"),
    **dict.fromkeys(("bart", "mbart", "marian", "pegasus", "blenderbot", "blenderbot-small", "plbart", "mvp",
                     "bigbird_pegasus", "trocr"), "absolute"),
}


# BERT-like decoders: causal, with a cache, only with ``is_decoder=True`` (BertModel.forward reads it), which
# from_encoder_decoder_pretrained sets; a config built otherwise leaves it False
CAUSAL_ONLY_AS_DECODER = tuple(t for t, kind in WRAPPED_DECODER_POSITIONS.items()
                               if kind.startswith("position_ids") and t not in ("gpt2", "gpt-sw3"))


def is_wrapper(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in WRAPPER_TYPES


def decoder_type(model) -> str | None:
    """The wrapped decoder's model_type."""
    return getattr(getattr(model.config, "decoder", None), "model_type", None)


def wrapped_position_kind(model, name: str) -> str:
    """How the decoder of wrapper ``model`` knows positions (a ``POSITION_KINDS`` value), or ValueError naming the
    wrapper, its decoder type and the reason."""
    inner = decoder_type(model)
    kind = WRAPPED_DECODER_POSITIONS.get(inner)
    if kind is None:
        raise ValueError(
            f"{name} ({type(model).__name__}, model_type {model.config.model_type!r}) wraps a decoder of type "
            f"{inner!r}, which speculative_kernels does not drive inside a wrapper (its position rule under "
            f"model.generate is not reviewed); supported decoders: {sorted(WRAPPED_DECODER_POSITIONS)}")
    if inner in CAUSAL_ONLY_AS_DECODER and not model.config.decoder.is_decoder:
        raise ValueError(
            f"{name} ({type(model).__name__}) wraps a {inner} decoder with is_decoder=False: it attends "
            "bidirectionally and keeps no cache, so model.generate re-encodes the whole decoder sequence at every "
            "step, which speculative decoding (a causal decoder over a KV cache) does not reproduce; set "
            "config.decoder.is_decoder=True (and add_cross_attention=True to attend to the encoder), as "
            "from_encoder_decoder_pretrained does")
    if inner == "trocr" and not model.config.decoder.use_learned_position_embeddings:
        return "absolute_skipping_pads"
    return kind


def position_module(model):
    """The wrapped decoder's position table module, read at each row's true positions by the runners' hooks (TrOCR's
    ``embed_positions``)."""
    return next(module for name, module in model.get_decoder().named_modules()
                if name.rsplit(".", 1)[-1] == "embed_positions")


def decoder_pad_id(model) -> int | None:
    """The pad id a decoder that numbers positions from its ids skips (RoBERTa's embeddings, TrOCR's sinusoids)."""
    return model.config.decoder.pad_token_id


def wrapped_position_limit(model) -> int | None:
    """The most positions the wrapped decoder numbers before model.generate fails inside its table (an IndexError):
    its config's ``max_position_embeddings`` (GPT-2's ``n_positions``; BART's and TrOCR's tables hold an offset of 2
    more, TrOCR's sinusoids the pad id's rows more, which a one-token step never grows), less the rows below a
    RoBERTa-like decoder's first position (pad + 1)."""
    limit = getattr(model.config.decoder, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    if wrapped_position_kind(model, "model") == "position_ids_skipping_pads":
        return limit - decoder_pad_id(model) - 1
    return limit


def decoder_kv_sizes(model) -> tuple[tuple[int, int, int], ...]:
    """(kv_heads, key_head_dim, value_head_dim) of each decoder self-attention layer, from the decoder's config:
    ``decoder_layers`` / ``decoder_attention_heads`` where it has them (the BART family's configs map
    num_hidden_layers and num_attention_heads to the encoder's), else num_hidden_layers / num_attention_heads (BERT's,
    GPT-2's through its attribute_map)."""
    config = model.config.decoder
    heads = getattr(config, "decoder_attention_heads", None) or config.num_attention_heads
    layers = getattr(config, "decoder_layers", None) or config.num_hidden_layers
    head_dim = config.hidden_size // heads
    return ((heads, head_dim, head_dim),) * layers


def passes_input_mask(model) -> bool:
    """Whether the wrapper derives the cross-attention mask from the encoder input's own mask in its forward
    (speech: the mask over the audio samples becomes one over the encoder's frames), so the runners must pass that
    mask [B, L] as the forward's ``attention_mask`` rather than a cross-attention mask of their own."""
    return getattr(model.config, "model_type", None) == "speech-encoder-decoder"


def source_in_decoder_vocabulary(model) -> bool:
    """Whether the encoder's token ids are ids of the decoder too, so prompt lookup may propose them: a wrapper whose
    encoder and decoder vocabularies have the same size (bert2bert, roberta2roberta); a roberta2bert's source ids run
    past BERT's vocabulary (IndexError in the decoder's embedding), a bert2gpt2's are other tokens. FSMT alike: its
    source and target dictionaries are its own (``src_vocab_size``, ``tgt_vocab_size``). Every other encoder-decoder
    shares one vocabulary."""
    if getattr(model.config, "model_type", None) == "fsmt":
        return model.config.src_vocab_size == model.config.tgt_vocab_size
    if not is_wrapper(model):
        return True
    return model.config.encoder.vocab_size == model.config.decoder.vocab_size


def encoder_input_name(model) -> str:
    """The keyword of the encoder's input: a wrapper's encoder's ``main_input_name`` (``pixel_values``,
    ``input_values``, ``input_features``, ``input_ids``), as model.generate reads it; ``input_ids`` otherwise."""
    if not is_wrapper(model):
        return "input_ids"
    return getattr(model.get_encoder(), "main_input_name", "input_ids")


FEATURE_INPUTS = ("pixel_values", "input_values", "input_features")


def check_encoder_input_keyword(model, name: str, kwargs: dict) -> None:
    """ValueError where a wrapper is given its encoder's input under another encoder's keyword (``input_features`` to a
    Wav2Vec2 encoder, which reads ``input_values``; ``input_values`` to a Speech2Text or Wav2Vec2-BERT one):
    model.generate fails there with an unrelated error (it starts from bos token ids and has no bos_token_id), and
    the general refusal of unknown keywords would call the input unsupported. name: the encoder's input
    (``encoder_input_name``)."""
    if not is_wrapper(model):
        return
    other = [key for key in FEATURE_INPUTS if key in kwargs and key != name]
    if other:
        raise ValueError(f"{other[0]} is not read by {type(model).__name__}'s encoder "
                         f"({type(model.get_encoder()).__name__}, which reads {name}): pass the input as {name}= "
                         "or positionally")


# GenerationConfig fields of HF's processors that read the encoder's token ids -> their "off" value
ENCODER_ID_PROCESSORS = {"encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0}


def check_encoder_id_processors(model, name: str, config) -> None:
    """ValueError where ``config`` (the resolved GenerationConfig) sets a processor that reads the encoder's token ids
    for a wrapper whose encoder reads features (``name``: pixel_values, input_values, input_features): there is no
    id to read, and model.generate ignores the setting with a warning or fails, by input and version (transformers
    5.17's encoder_repetition_penalty gathers at the float input_values: RuntimeError); the runners would ignore it."""
    for field, off in ENCODER_ID_PROCESSORS.items():
        value = getattr(config, field, None)
        if value is not None and value != off:
            raise ValueError(f"{field}={value} reads the encoder's token ids, and {type(model).__name__}'s encoder "
                             f"reads {name} (model.generate ignores it with a warning, or fails, depending on the "
                             "input and the transformers version); leave it out")


def feature_tensor(name: str, values, device: torch.device) -> torch.Tensor:
    """A vision or speech encoder input ([B, ...] floating point) on ``device`` (TypeError / ValueError naming it)."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if not values.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (the encoder's {name}), got {values.dtype}")
    if values.dim() < 2 or values.shape[0] == 0:
        raise ValueError(f"{name} must be a [batch, ...] tensor with at least one row, got shape "
                         f"{tuple(values.shape)}")
    return values.to(device)
