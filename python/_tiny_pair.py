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
    """Parse --target/--draft: (target, draft, the target folder's tokenizer or None) loaded with from_pretrained, or
    the tiny pair (no tokenizer)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", help="local HF folder (default: a tiny random model)")
    parser.add_argument("--draft", help="local HF folder (default: a tiny random model)")
    args = parser.parse_args()
    if bool(args.target) != bool(args.draft):
        parser.error("give both --target and --draft, or neither")
    if args.target:
        from speculative_kernels.model_loading import load_model

        target, tokenizer = load_model(args.target)
        return target, load_model(args.draft)[0], tokenizer
    return (*tiny_pair(), None)


TEXTS = ("def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time")
IDS = ([1, 17, 42, 99, 7], [1, 5, 9], [1, 8, 3, 2, 6], [1, 23, 11, 64])  # for the tiny pair, which has no tokenizer


def prompts(target, tokenizer, count: int):
    """(input_ids [count, n], attention_mask [count, n]): ``count`` example prompts, left-padded with the target's
    pad id. Texts encoded with ``tokenizer`` (the target folder's); None: token ids within the target's vocabulary
    (the tiny pair)."""
    if tokenizer is not None:
        rows = [tokenizer(text)["input_ids"] for text in TEXTS[:count]]
    else:
        rows = [[i % target.config.vocab_size for i in ids] for ids in IDS[:count]]
    pad = target.generation_config.pad_token_id
    pad = 0 if pad is None else (pad[0] if isinstance(pad, list) else pad)
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return input_ids, mask
