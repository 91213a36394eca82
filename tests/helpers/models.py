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
