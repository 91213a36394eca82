"""Tiny random-weight generic encoder-decoder wrappers (``EncoderDecoderModel``, ``VisionEncoderDecoderModel``,
``SpeechEncoderDecoderModel``) built from configs (nothing is downloaded).

Ids: decoder start 1, eos 2, pad 0 (RoBERTa's and TrOCR's decoders: pad 1, so their position numbering from the pad
id is exercised). The decoders' position tables and cross-attention outputs are scaled up so that the tokens depend
on every position and on the source (at default initialisation a tiny decoder repeats one token whatever its input).
"""

import torch
from transformers import (BertConfig, EncoderDecoderConfig, EncoderDecoderModel, GPT2Config, RobertaConfig,
                          SpeechEncoderDecoderConfig, SpeechEncoderDecoderModel, TrOCRConfig, ViTConfig,
                          VisionEncoderDecoderConfig, VisionEncoderDecoderModel, Wav2Vec2BertConfig, Wav2Vec2Config)

VOCAB = 97


def _bert(layers: int, hidden: int, **extra):
    return BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=2 * hidden, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, pad_token_id=0, **extra)


def _roberta(layers: int, hidden: int, **extra):
    return RobertaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         intermediate_size=2 * hidden, max_position_embeddings=70, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, **extra)


def _gpt2(layers: int, hidden: int, **extra):
    return GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)


def _trocr(layers: int, hidden: int, learned: bool = True, **extra):
    return TrOCRConfig(vocab_size=VOCAB, d_model=hidden, decoder_layers=layers, decoder_attention_heads=4,
                       decoder_ffn_dim=2 * hidden, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                       activation_dropout=0.0, decoder_layerdrop=0.0, use_learned_position_embeddings=learned,
                       layernorm_embedding=learned, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                       decoder_start_token_id=2, **extra)


DECODERS = {"bert": _bert, "roberta": _roberta, "gpt2": _gpt2, "trocr": _trocr,
            "trocr-sinusoidal": lambda layers, hidden: _trocr(layers, hidden, learned=False)}


def _decoder_config(kind: str, layers: int, hidden: int):
    config = DECODERS[kind](layers, hidden)
    config.is_decoder, config.add_cross_attention = True, True
    return config


def _sensitive(model, seed: int):
    """Scale the decoder's position tables and cross-attention outputs (see the module docstring)."""
    torch.manual_seed(seed + 1000)
    with torch.no_grad():
        for name, weight in model.decoder.named_parameters():
            if "position" in name or name.endswith("wpe.weight"):
                weight.normal_(0.0, 1.0)
            elif ("crossattention.output.dense.weight" in name or "crossattention.c_proj.weight" in name
                  or "encoder_attn.out_proj.weight" in name):
                weight.mul_(4.0)
    return model


def _ids(config, decoder_kind: str):
    pad = 1 if decoder_kind.startswith(("roberta", "trocr")) else 0
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 3, pad, 2
    return config


def text_wrapper(encoder: str, decoder: str, layers: int = 2, hidden: int = 32, seed: int = 0,
                 encoder_vocab: int = VOCAB):
    """EncoderDecoderModel: a BERT or RoBERTa encoder (of ``encoder_vocab`` ids) and a ``DECODERS`` decoder
    (bert2bert, bert2gpt2, ...)."""
    torch.manual_seed(seed)
    encoder_config = DECODERS[encoder](layers, hidden)
    encoder_config.vocab_size = encoder_vocab
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder_config,
                                                               _decoder_config(decoder, layers, hidden))
    return _sensitive(EncoderDecoderModel(config=_ids(config, decoder)).eval(), seed)


def text_wrapper_of(decoder: str, seed: int = 0):
    """EncoderDecoderModel: a BERT encoder and a decoder of any ``model_type`` with a causal-LM class that
    cross-attends, from its default config at tiny sizes (pad 1); positions and cross-attention scaled up."""
    from transformers import AutoConfig

    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64, is_decoder=True, add_cross_attention=True, pad_token_id=1)
    try:  # (BART-like configs name their decoder's sizes)
        config = AutoConfig.for_model(decoder, **sizes, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                      decoder_ffn_dim=64)
    except (TypeError, ValueError):
        config = AutoConfig.for_model(decoder, **sizes, embedding_size=32)
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout",
                 "activation_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(seed)
    wrapper = EncoderDecoderConfig.from_encoder_decoder_configs(_bert(2, 32), config)
    wrapper.decoder_start_token_id, wrapper.pad_token_id, wrapper.eos_token_id = 3, 1, 2
    return _sensitive(EncoderDecoderModel(config=wrapper).eval(), seed)


def vision_wrapper(decoder: str, layers: int = 2, hidden: int = 32, seed: int = 0):
    """VisionEncoderDecoderModel: a ViT encoder (16x16 images, 4 patches) and a ``DECODERS`` decoder (TrOCR, GPT-2)."""
    torch.manual_seed(seed)
    vit = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=4, intermediate_size=2 * hidden, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, _decoder_config(decoder, layers, hidden))
    return _sensitive(VisionEncoderDecoderModel(config=_ids(config, decoder)).eval(), seed)


def speech_wrapper(decoder: str, layers: int = 2, hidden: int = 32, seed: int = 0):
    """SpeechEncoderDecoderModel: a Wav2Vec2 encoder (two conv layers, stride 4: 4 samples a frame) and a
    ``DECODERS`` decoder. Its layer-norm feature extractor takes an attention mask (a padded batch)."""
    torch.manual_seed(seed)
    wav2vec2 = Wav2Vec2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                              intermediate_size=2 * hidden, conv_dim=(16, 16), conv_stride=(2, 2), conv_kernel=(2, 2),
                              num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, feat_extract_norm="layer",
                              do_stable_layer_norm=True, hidden_dropout=0.0, attention_dropout=0.0,
                              activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
                              vocab_size=VOCAB)
    config = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(wav2vec2,
                                                                     _decoder_config(decoder, layers, hidden))
    return _sensitive(SpeechEncoderDecoderModel(config=_ids(config, decoder)).eval(), seed)


def features_wrapper(decoder: str = "bert", layers: int = 2, hidden: int = 32, seed: int = 2):
    """SpeechEncoderDecoderModel whose encoder reads ``input_features`` [B, T, 8] (Wav2Vec2-BERT, its adapter halving
    the frames: T / 2) and a ``DECODERS`` decoder. The decoder's cross-attention keys and values are scaled up too
    (x8): at default scale the tokens hardly depend on this encoder's output (seed 2: the two rows of
    ``features([15, 24], seed=2)`` differ in 5 of 12 greedy tokens, and 3 change without the attention mask)."""
    torch.manual_seed(seed)
    encoder = Wav2Vec2BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                 intermediate_size=2 * hidden, feature_projection_input_dim=8,
                                 conv_depthwise_kernel_size=3, add_adapter=True, adapter_kernel_size=3,
                                 adapter_stride=2, num_adapter_layers=1, output_hidden_size=hidden,
                                 position_embeddings_type="relative_key", left_max_position_embeddings=16,
                                 right_max_position_embeddings=4, hidden_dropout=0.0, attention_dropout=0.0,
                                 activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
                                 vocab_size=VOCAB)
    config = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, _decoder_config(decoder, layers, hidden))
    model = _sensitive(SpeechEncoderDecoderModel(config=_ids(config, decoder)).eval(), seed)
    with torch.no_grad():
        for name, weight in model.decoder.named_parameters():
            if name.endswith(("crossattention.self.key.weight", "crossattention.self.value.weight")):
                weight.mul_(8.0)
    return model


def features(lengths, seed: int = 0):
    """(input_features [B, max(lengths), 8] right-padded with zeros, attention_mask [B, max(lengths)])."""
    g = torch.Generator().manual_seed(seed)
    values = torch.zeros(len(lengths), max(lengths), 8)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    for row, length in enumerate(lengths):
        values[row, :length] = torch.randn(length, 8, generator=g)
        mask[row, :length] = 1
    return values, mask


def images(batch: int, seed: int = 0) -> torch.Tensor:
    """pixel_values [batch, 3, 16, 16]."""
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def audio(lengths, seed: int = 0):
    """(input_values [B, max(lengths)] right-padded with zeros, attention_mask [B, max(lengths)])."""
    g = torch.Generator().manual_seed(seed)
    values = torch.zeros(len(lengths), max(lengths))
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    for row, length in enumerate(lengths):
        values[row, :length] = torch.randn(length, generator=g)
        mask[row, :length] = 1
    return values, mask
