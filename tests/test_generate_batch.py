"""Batch > 1: each row accepts its own count; greedy output equals HF's on the same left-padded batch."""

import pytest
import torch

import speculative_kernels as sk
from models import FAMILIES, drafts_for, llama


def _left_padded(lengths, seed=0, pad=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, 97, (length,), generator=g)
        mask[row, width - length:] = 1
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("lengths", [[5, 9], [3, 8, 6, 1], [4, 4, 7, 2, 9, 5, 6, 3]])
def test_batched_greedy_matches_hf_per_row(family, lengths):
    target = FAMILIES[family]()
    draft = drafts_for(family, target)["perturbed" if len(lengths) % 2 else "unrelated"]
    ids, mask = _left_padded(lengths)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                      max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)


def test_rows_finish_at_different_times_and_on_first_token():
    target = llama()
    draft = llama(layers=1, seed=8)
    ids, mask = _left_padded([6, 4, 7, 5], seed=2)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    eos = int(free[1, ids.shape[1]])  # row 1's very first new token becomes EOS
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                               pad_token_id=0)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=4,
                      max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0,
                      speculation_stats=stats)
    assert torch.equal(got, expected)
    assert got[1, ids.shape[1]] == eos and bool((got[1, ids.shape[1] + 1:] == 0).all())
    lengths = []
    for row in got[:, ids.shape[1]:].tolist():
        lengths.append(row.index(eos) + 1 if eos in row else len(row))
    assert stats.new_tokens == sum(lengths)


def test_self_draft_batch_accepts_everything():
    target = llama()
    ids, mask = _left_padded([5, 3, 6])
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, draft_model=target, num_speculative_tokens=3,
                      max_new_tokens=12, do_sample=False, pad_token_id=0, speculation_stats=stats)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(got, expected)
    assert stats.acceptance_rate == 1.0 and stats.accepted_histogram == [0, 0, 0, 3 * 3]
