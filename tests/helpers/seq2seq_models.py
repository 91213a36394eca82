"""Tiny random-weight encoder-decoder models (T5, BART, mBART) built from configs (nothing is downloaded).

At default initialisation such tiny models repeat one token whatever the input, which would let a position bug
through; the weights are scaled up (and the decoder's position tables most of all) so that outputs depend on the
source and on every decoder position.

The scaling must keep the models well conditioned: the tests compare our tokens and logits with HF's, computed in a
different order (a multi-token verification forward against HF's one-token steps; other matmul blocking on another
CPU or thread count), so float32 rounding must stay far below the gaps between the top logits. T5 does not divide its
attention scores by sqrt(d), so they grow as the fourth power of a global weight scale; at initializer_factor=5 (the
first version) scores of several hundred amplified float32 rounding to 5e-3 of the logits' range, more than the
smallest top-1/top-2 gap of a greedy run, so HF's own greedy tokens depended on the CPU. Here the attention stays at a
moderate scale and the residual branches and the position bias carry the sensitivity instead (float32 error ~1e-6 of
the logits' range, checked against float64 by ``float_error.assert_logits_as_accurate_as_hf``).
"""

import functools

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MBartConfig,
    MBartForConditionalGeneration,
    MT5Config,
    MT5ForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
)

from helpers.models import decoder_only_families, perturbed

VOCAB = 97


def t5(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0, mt5: bool = False):
    """T5 (or MT5, the same architecture in its own classes) ids: pad = decoder start = 0, eos = 1.

    initializer_factor 1.5 keeps attention scores of order ten; the residual branches' output projections (x2) and
    the decoder's relative position bias (x20, exact table values, so no rounding is amplified) make the output
    depend on the source and on the decoder position."""
    torch.manual_seed(seed)
    config_class, model_class = (MT5Config, MT5ForConditionalGeneration) if mt5 else (T5Config,
                                                                                   T5ForConditionalGeneration)
    config = config_class(
        vocab_size=vocab, d_model=hidden, d_kv=hidden // 4, d_ff=2 * hidden, num_layers=layers, num_heads=4,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, initializer_factor=1.5,
    )
    model = model_class(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("SelfAttention.o.weight", "EncDecAttention.o.weight", "DenseReluDense.wo.weight")):
                weight.mul_(2.0)
        model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(20.0)
    return model


def _position_sensitive(model):
    with torch.no_grad():
        model.model.decoder.embed_positions.weight.normal_(0.0, 2.0)
    return model


def _bart_kwargs(layers, hidden, vocab):
    return dict(
        vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * hidden, decoder_ffn_dim=2 * hidden, max_position_embeddings=256,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.2,
    )


def bart(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0) -> BartForConditionalGeneration:
    """BART ids: bos = 0, pad = 1, eos = decoder start = 2; forced_bos_token_id = 0 as in bart-large-cnn (the
    default config also forces EOS at max_length - 1)."""
    torch.manual_seed(seed)
    config = BartConfig(**_bart_kwargs(layers, hidden, vocab), bos_token_id=0, pad_token_id=1, eos_token_id=2,
                        decoder_start_token_id=2, forced_bos_token_id=0)
    model = _position_sensitive(BartForConditionalGeneration(config).eval())
    model.generation_config.forced_bos_token_id = 0
    return model


def mbart(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0) -> MBartForConditionalGeneration:
    """mBART-50 style: decoder start = eos = 2, the target language code (id 5) forced as the first token."""
    torch.manual_seed(seed)
    config = MBartConfig(**_bart_kwargs(layers, hidden, vocab), bos_token_id=0, pad_token_id=1, eos_token_id=2,
                         decoder_start_token_id=2, forced_bos_token_id=5, scale_embedding=True)
    model = _position_sensitive(MBartForConditionalGeneration(config).eval())
    model.generation_config.forced_bos_token_id = 5
    return model


SEQ2SEQ_FAMILIES = {"t5": t5, "bart": bart, "mbart": mbart}


# Weight noise of the "perturbed" draft: the well-conditioned T5 needs more than the default 2% for its perturbed draft
# to be rejected now and then (greedy and sampled acceptance 0.15-0.65 on the tests' inputs; 0.4-1.0 at 2%).
PERTURBATION = {"t5": 0.1}


def seq2seq_drafts_for(family: str, target):
    """Draft models from useless to perfect: the target itself, a perturbed copy, an unrelated small model."""
    return {
        "self": target,
        "perturbed": perturbed(target, scale=PERTURBATION.get(family, 0.02)),
        "unrelated": SEQ2SEQ_FAMILIES[family](layers=1, hidden=16, seed=123),
    }


def source_batch(lengths, seed: int = 0, pad: int = 0, low: int = 3):
    """Right-padded encoder inputs of the given lengths (seq2seq tokenizers pad on the right) and their mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(low, VOCAB, (length,), generator=g)
        mask[row, :length] = 1
    return ids, mask


def save_t5_pair(root):
    """Target (2 layers) and draft (1 layer) T5 folders sharing a tiny word-level tokenizer. Returns their paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["translate English to German: the house is small", "summarize: the cat sat on the mat",
              "translate English to German: the book is on the table", "summarize: a dog ran in the park"] * 5
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    paths = []
    for name, model in (("target", t5(layers=2, vocab=len(tokenizer), seed=0)),
                        ("draft", t5(layers=1, vocab=len(tokenizer), seed=1))):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


# BART-like families (transformers' Bart copies with their own position modules): model_type -> (pad, eos, decoder
# start, forced_bos or None, extra config). Marian and Pegasus start the decoder with the pad token, as their
# checkpoints do; Marian's and Pegasus's positions are sinusoidal tables, the others' learned.
BART_LIKE = {
    "marian": (1, 2, 1, None, dict(scale_embedding=True, share_encoder_decoder_embeddings=True)),
    "pegasus": (0, 1, 0, None, dict(scale_embedding=True)),
    "blenderbot": (0, 2, 1, None, {}),
    "blenderbot-small": (0, 2, 1, None, {}),
    "plbart": (1, 2, 2, None, dict(scale_embedding=True)),
    "mvp": (1, 2, 2, 0, {}),
    "m2m_100": (1, 2, 2, 5, dict(scale_embedding=True)),  # NLLB's ids: the target language (5) forced first
    "bigbird_pegasus": (0, 1, 0, None, dict(attention_type="original_full", scale_embedding=True)),
}


def bart_like(model_type: str, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0):
    """A tiny model of a BART-like family (``BART_LIKE``), its decoder's position table scaled up so that outputs
    depend on each decoder position (a sinusoidal table x3, a learned one redrawn as BART's)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    pad, eos, start, forced_bos, extra = BART_LIKE[model_type]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **_bart_kwargs(layers, hidden, vocab), bos_token_id=0, pad_token_id=pad,
                                  eos_token_id=eos, decoder_start_token_id=start, forced_bos_token_id=forced_bos,
                                  **extra)
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    table = model.get_decoder().embed_positions
    with torch.no_grad():
        if "Sinusoidal" not in type(table).__name__:
            table.weight.normal_(0.0, 2.0)
        elif isinstance(table, torch.nn.Embedding):
            table.weight.mul_(3.0)
        else:  # M2M100's buffer (its make_weights would rebuild it unscaled if a request outgrew it)
            table.weights.mul_(3.0)
    model.generation_config.forced_bos_token_id = forced_bos
    return model


T5_LIKE = ("umt5", "longt5", "switch_transformers")


def t5_like(model_type: str, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0):
    """A tiny UMT5, LongT5 or Switch Transformers model (T5's ids and relative position buckets; UMT5 a bias table
    per layer, LongT5 a local-attention encoder, Switch two experts in one sparse layer per stack), scaled as
    ``t5``: the decoder's position bias tables x20."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    extra = dict(num_experts=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1) \
        if model_type == "switch_transformers" else {}
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab, d_model=hidden, d_kv=hidden // 4, d_ff=2 * hidden, num_layers=layers,
        num_decoder_layers=layers, num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, initializer_factor=1.5, **extra)
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.startswith("decoder.") and "relative_attention_bias" in name:
                weight.mul_(20.0)
    return model


def t5gemma(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0, window: int = 4):
    """A tiny T5Gemma (rotary decoder positions given as decoder_position_ids; sliding-window and full layers in
    turn, the window small enough to bind): pad = 0, eos = 1, decoder start = bos = 2."""
    from transformers import T5GemmaConfig, T5GemmaForConditionalGeneration

    torch.manual_seed(seed)
    module = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=hidden // 4, vocab_size=vocab, sliding_window=window,
                  layer_types=(["sliding_attention", "full_attention"] * layers)[:layers], pad_token_id=0,
                  eos_token_id=1, bos_token_id=2, query_pre_attn_scalar=hidden // 4)
    config = T5GemmaConfig(encoder=module, decoder=module, vocab_size=vocab, pad_token_id=0, eos_token_id=1,
                           bos_token_id=2, decoder_start_token_id=2, attn_implementation="eager")
    model = T5GemmaForConditionalGeneration(config).eval()
    with torch.no_grad():  # residual branches x2: outputs that depend on the source and on every position
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.mul_(2.0)
    return model


def t5gemma2(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0, window: int = 4,
             attention: str = "eager"):
    """A tiny T5Gemma 2 (T5Gemma's decoder with merged self- and cross-attention; a one-layer SigLIP tower in the
    encoder, unused for text): pad = 0, eos = 1, bos = 2 (the decoder start)."""
    from transformers import T5Gemma2Config, T5Gemma2ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=hidden // 4, vocab_size=vocab, sliding_window=window,
                layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
                query_pre_attn_scalar=hidden // 4)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=8)
    config = T5Gemma2Config(encoder=dict(text_config=text, vision_config=vision, mm_tokens_per_image=4), decoder=text,
                            pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation=attention)
    model = T5Gemma2ForConditionalGeneration(config).eval()
    with torch.no_grad():  # residual branches x2, as t5gemma's
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.mul_(2.0)
    return model


def pegasus_x(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0):
    """A tiny Pegasus-X (sinusoids computed from position ids; a block-local encoder with global tokens): pad =
    decoder start = 0, eos = 1. Its own head (untied) and Linear weights redrawn at std 1/sqrt(fan_in), unscaled
    token embeddings: at HF's initialisation every row repeats one token whatever the positions."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("pegasus_x", **_bart_kwargs(layers, hidden, vocab), pad_token_id=0, eos_token_id=1,
                                  decoder_start_token_id=0, block_size=4, num_global_tokens=2, scale_embedding=False,
                                  tie_word_embeddings=False)
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.weight.shape[1] ** -0.5)
    return model


def fsmt(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0, positions: int = 64,
         target_vocab: int | None = None):
    """A tiny FSMT (facebook/wmt19's architecture: fairseq sinusoids read from the token ids, its own output
    projection): bos = 0, pad = 1, eos = decoder start = 2; greedy (FSMT's config defaults to num_beams=5).
    positions: max_position_embeddings, the sinusoid table's initial size (FSMT grows it as positions need);
    target_vocab: the decoder's vocabulary size (FSMT's own dictionary), ``vocab`` by default."""
    from transformers import FSMTConfig, FSMTForConditionalGeneration

    torch.manual_seed(seed)
    config = FSMTConfig(
        langs=["en", "de"], src_vocab_size=vocab, tgt_vocab_size=target_vocab or vocab, d_model=hidden, encoder_layers=layers,
        decoder_layers=layers, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * hidden,
        decoder_ffn_dim=2 * hidden, max_position_embeddings=positions, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, init_std=0.2, bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2,
        tie_word_embeddings=False, num_beams=1)
    model = FSMTForConditionalGeneration(config).eval()
    model.generation_config.num_beams = 1
    return model


# The families above beside t5/bart/mbart, for the differential harnesses (helpers.differential,
# helpers.sampling_differential): name -> builder taking (layers, hidden, vocab, seed).
NEW_SEQ2SEQ_FAMILIES = {**{kind: functools.partial(bart_like, kind) for kind in BART_LIKE},
                        **{kind: functools.partial(t5_like, kind) for kind in T5_LIKE}, "t5gemma": t5gemma,
                        "t5gemma2": t5gemma2, "pegasus_x": pegasus_x, "fsmt": fsmt}
ALL_SEQ2SEQ_FAMILIES = {**SEQ2SEQ_FAMILIES, **NEW_SEQ2SEQ_FAMILIES}


def special_ids(family: str) -> tuple[int, int, int]:
    """(pad, eos, decoder start) of ``family``'s tiny models (``ALL_SEQ2SEQ_FAMILIES``)."""
    if family in BART_LIKE:
        return BART_LIKE[family][:3]
    return {"t5": (0, 1, 0), "t5gemma": (0, 1, 2), "t5gemma2": (0, 1, 2), "pegasus_x": (0, 1, 0),
            "fsmt": (1, 2, 2)}.get(family, (0, 1, 0) if family in T5_LIKE else (1, 2, 2))


def family_model(family: str, **kwargs):
    """A tiny random model of ``family``: a decoder-only family of ``helpers.models.decoder_only_families`` or one of
    ``SEQ2SEQ_FAMILIES`` (t5, bart, mbart); kwargs go to its builder."""
    make = SEQ2SEQ_FAMILIES[family] if family in SEQ2SEQ_FAMILIES else decoder_only_families()[family]
    return make(**kwargs)
