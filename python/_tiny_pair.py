"""A tiny random-weight Llama pair for the examples, or a user's pair loaded from local folders."""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_pair(vocab: int = 256):
    """(target, draft): random weights, 4 and 1 layers, one vocabulary."""
    torch.manual_seed(0)
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **base)).eval()
    draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **base)).eval()
    return target, draft


def pair_from_args(description: str):
    """Parse --target/--draft; load them with from_pretrained, or build the tiny pair."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", help="local HF folder (default: a tiny random model)")
    parser.add_argument("--draft", help="local HF folder (default: a tiny random model)")
    args = parser.parse_args()
    if bool(args.target) != bool(args.draft):
        parser.error("give both --target and --draft, or neither")
    if args.target:
        from speculative_kernels.model_loading import load_model

        return load_model(args.target)[0], load_model(args.draft)[0]
    return tiny_pair()
