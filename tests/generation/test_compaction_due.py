"""When the loop compacts a batch's caches (``runners/compaction.py``: ``SlotCompactor.due``)."""

import torch

import speculative_kernels as sk
from helpers.models import llama
from speculative_kernels.generation.runners.compaction import SlotCompactor


def test_holes_no_compaction_can_remove_do_not_trigger_one():
    """Left padding of prompts of different lengths is a hole compaction cannot remove (the width shrinks to the
    longest row's): counted, it compacted after nearly every iteration for nothing. Here every draft is accepted
    (the target drafts for itself), so the only holes are the padding: no compaction (before: 6)."""
    target = llama()
    ids = torch.randint(3, 97, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = mask[2, :6] = mask[3, :10] = 0
    stats = sk.SpeculationStats()
    sk.generate(target, ids, attention_mask=mask, draft_model=target, num_speculative_tokens=3, max_new_tokens=24,
                do_sample=False, pad_token_id=0, eos_token_id=None, speculation_stats=stats)
    assert stats.accepted_tokens == stats.drafted_tokens and stats.compactions == 0, stats
    compactor = SlotCompactor(batch=2, threshold=0.25)
    compactor.counts_read([30, 10])  # 20 of 40 slots are holes, but the longest row fills 30: frees 10 (25%)
    assert compactor.due(40) is None
    compactor.counts_read([29, 10])  # frees 11 of 40
    assert compactor.due(40) == 29
    compactor.counts_read([30, 10])  # the next iteration would not fit
    assert compactor.due(40, reserve=4, capacity=43) == 30
