"""Prompt batches for the generation tests."""

import torch


def left_padded(lengths, seed=0, pad=0):
    """(input_ids, attention_mask) [B, max(lengths)]: random ids in 3..96, row b left-padded to lengths[b]."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, 97, (length,), generator=g)
        mask[row, width - length:] = 1
    return ids, mask
