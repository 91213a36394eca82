"""Tiny random-weight HF models built from configs in the tests (nothing is downloaded)."""

import copy

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 97
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def llama(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **SPECIAL,
    )
    return LlamaForCausalLM(config).eval()


def gpt2(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512, **SPECIAL)
    return GPT2LMHeadModel(config).eval()


def qwen2(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **SPECIAL,
    )
    return Qwen2ForCausalLM(config).eval()


FAMILIES = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2}


def perturbed(model, scale: float = 0.02, seed: int = 1):
    """A copy of ``model`` with Gaussian noise added to every weight: a good but imperfect draft."""
    torch.manual_seed(seed)
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for p in copy_.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp(min=1e-3))
    return copy_


def drafts_for(family: str, target):
    """Draft models from useless to perfect: the target itself, a perturbed copy, an unrelated small model."""
    make = FAMILIES[family]
    return {
        "self": target,
        "perturbed": perturbed(target),
        "unrelated": make(layers=1, hidden=16, seed=123),
    }


def hf_generate(model, ids, **kwargs):
    """``model.generate(ids, **kwargs)`` with HF's warnings silenced (the reference side of a comparison)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **kwargs)


def _tiny(config_class, model_class, seed: int, vocab: int, **fields):
    torch.manual_seed(seed)
    return model_class(config_class(vocab_size=vocab, **SPECIAL, **fields)).eval()


def more_families():
    """Decoder-only families for the differential harness's script runs only (``--family``; not in the suite):
    each with what sets it apart small enough to matter at the harness's lengths (windows of 4 tokens, soft-capping,
    ALiBi, learned positions with an offset, partial rotary)."""
    import transformers as t

    def family(config, model, **fields):
        def make(layers: int = 2, hidden: int = 32, vocab: int = VOCAB, seed: int = 0):
            sized = {k: v(layers, hidden) if callable(v) else v for k, v in fields.items()}
            return _tiny(getattr(t, config), getattr(t, model), seed, vocab, **sized)
        return make

    llama_like = dict(hidden_size=lambda l, h: h, intermediate_size=lambda l, h: 2 * h,
                      num_hidden_layers=lambda l, h: l, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512)
    return {
        "mistral": family("MistralConfig", "MistralForCausalLM", sliding_window=4, **llama_like),
        "gemma2": family("Gemma2Config", "Gemma2ForCausalLM", sliding_window=4, head_dim=8,
                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **llama_like),
        "qwen3": family("Qwen3Config", "Qwen3ForCausalLM", head_dim=8, **llama_like),
        "phi3": family("Phi3Config", "Phi3ForCausalLM", **llama_like),
        "opt": family("OPTConfig", "OPTForCausalLM", hidden_size=lambda l, h: h, ffn_dim=lambda l, h: 2 * h,
                      num_hidden_layers=lambda l, h: l, num_attention_heads=4, word_embed_proj_dim=lambda l, h: h,
                      max_position_embeddings=512),
        "bloom": family("BloomConfig", "BloomForCausalLM", hidden_size=lambda l, h: h, n_layer=lambda l, h: l,
                        n_head=4),
        "gpt_neox": family("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=lambda l, h: h,
                           intermediate_size=lambda l, h: 2 * h, num_hidden_layers=lambda l, h: l,
                           num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=512),
        "falcon": family("FalconConfig", "FalconForCausalLM", hidden_size=lambda l, h: h,
                         num_hidden_layers=lambda l, h: l, num_attention_heads=4, new_decoder_architecture=True,
                         num_kv_heads=2),
    }


def decoder_only_families() -> dict:
    """Every decoder-only family the differential harness can build: the suite's and ``more_families``."""
    return {**FAMILIES, **more_families()}
