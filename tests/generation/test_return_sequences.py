"""num_return_sequences with sampling: each prompt repeated, its rows together, as model.generate does; each row an
independent sample of the target's distribution."""

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper

import speculative_kernels as sk
from helpers.models import llama
from helpers.sampling import NEW, VOCAB, continuation_probs, peaky
from helpers.seq2seq_models import t5
from helpers.stats import assert_matches


def test_rows_are_samples_of_the_target_distribution():
    target, draft = peaky(0, 2), peaky(7, 1)
    prompt = torch.tensor([[1, 4, 3, 5]])
    _, probs = continuation_probs(target, prompt, LogitsProcessorList([TemperatureLogitsWarper(1.2)]))
    out = sk.generate(target, prompt, draft_model=draft, num_speculative_tokens=2, do_sample=True, temperature=1.2,
                      num_return_sequences=3000, max_new_tokens=NEW, pad_token_id=0, seed=5)
    assert out.shape == (3000, prompt.shape[1] + NEW)
    codes = (out[:, prompt.shape[1]:].numpy() * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


def test_layout_as_model_generate_and_seeded_rows():
    """[B * n, ...], prompt b's n rows together (as HF's repeat_interleave); with a seed, row r of the call is the
    row r of the same call on the repeated batch."""
    target, draft = llama(), llama(layers=1, seed=3)
    ids = torch.tensor([[0, 0, 84, 39, 64], [5, 6, 7, 8, 9]])
    mask = (ids != 0).long()
    kwargs = dict(do_sample=True, max_new_tokens=8, pad_token_id=0, seed=11)
    out = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_return_sequences=3, **kwargs)
    torch.manual_seed(0)
    hf = target.generate(ids, attention_mask=mask, num_return_sequences=3, do_sample=True, max_new_tokens=8,
                         pad_token_id=0)
    assert out.shape == hf.shape == (6, 13)
    assert torch.equal(out[:, :5], hf[:, :5])  # the prompts, in HF's order
    repeated = sk.generate(target, ids.repeat_interleave(3, 0), attention_mask=mask.repeat_interleave(3, 0),
                           draft_model=draft, **kwargs)
    assert torch.equal(out, repeated)
    assert len({tuple(row) for row in out[:3, 5:].tolist()}) > 1  # independent samples, not copies


def test_encoder_decoder_inputs_are_repeated():
    target, draft = t5(), t5(layers=1, seed=5)
    source = torch.tensor([[12, 40, 7, 7, 33], [40, 12, 9, 0, 0]])
    mask = (source != 0).long()
    outputs = target.get_encoder()(input_ids=source, attention_mask=mask)
    kwargs = dict(do_sample=True, max_new_tokens=6, seed=3, draft_model=draft)
    out = sk.generate(target, source, attention_mask=mask, num_return_sequences=2, **kwargs)
    assert out.shape[0] == 4
    assert torch.equal(out, sk.generate(target, source.repeat_interleave(2, 0),
                                        attention_mask=mask.repeat_interleave(2, 0), **kwargs))
    from_outputs = sk.generate(target, attention_mask=mask, encoder_outputs=outputs, num_return_sequences=2,
                               do_sample=True, max_new_tokens=6, seed=3, prompt_lookup_num_tokens=2)
    assert from_outputs.shape[0] == 4


def test_greedy_refused_as_in_hf():
    target, draft = llama(), llama(layers=1, seed=3)
    with pytest.raises(ValueError, match="num_return_sequences"):
        sk.generate(target, torch.tensor([[5, 6, 7]]), draft_model=draft, num_return_sequences=2, max_new_tokens=3)


def test_prefix_allowed_tokens_fn_gets_the_batch_id_model_generate_passes():
    """transformers 5.24 gives prefix_allowed_tokens_fn the prompt's index for each of its num_return_sequences rows
    (5.17-5.23: the row's own index). A function that allows one token per batch_id makes either rule visible in the
    tokens: the output equals model.generate's, and the function sees the same batch ids. (This call crashed inside
    transformers 5.24's processor, which a one-row call left with a group of no rows.)"""
    target, draft = llama(), llama(layers=1, seed=3)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    seen = {"hf": set(), "sk": set()}

    def allowed(key):
        def fn(batch_id, input_ids):
            seen[key].add(batch_id)
            return [5 + 2 * batch_id]
        return fn

    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=4, num_return_sequences=2,
                  pad_token_id=0)
    hf = target.generate(ids, prefix_allowed_tokens_fn=allowed("hf"), **kwargs)
    out = sk.generate(target, ids, draft_model=draft, prefix_allowed_tokens_fn=allowed("sk"), **kwargs)
    assert torch.equal(out, hf)
    assert seen["sk"] == seen["hf"]
