"""The static cache's eager forwards read the slots written so far only (``SlotCache.reading``): an unpadded
prompt's first forward gets SDPA's causal kernel over its T keys, as ``model.generate``'s static prefill does; a
padded or later chunk's forward, and the draft and verification steps, a mask over the slots written, never the
whole preallocated cache. Tokens are ``model.generate``'s (``cache_implementation="static"``) at batch 1 and in a
left-padded batch, SDPA and eager."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import speculative_kernels as sk
from helpers.models import hf_generate, llama
from helpers.prompts import left_padded
from speculative_kernels.generation.runners.static_decoder import StaticDecoderRunner

LENGTH = 9


def _prompts(batch):
    """batch 1: one prompt of LENGTH tokens; batch 3: left-padded rows of LENGTH, 4 and 6 tokens."""
    if batch == 1:
        return torch.randint(3, 97, (1, LENGTH), generator=torch.Generator().manual_seed(0)), None
    return left_padded([LENGTH, 4, 6])


def _record_attention(monkeypatch, models, prompt: bool) -> list:
    """Every attention call inside a static runner's prompt forwards (``prompt``), or its other forwards, as (slots
    written by the end of that forward, query length, key length, mask shape or None, is_causal): SDPA's arguments,
    or under eager attention the attention weights [B, H, T, S] its modules return and the mask transformers gave
    them."""
    calls, inside = [], []
    forward, sdpa = StaticDecoderRunner.forward, torch.nn.functional.scaled_dot_product_attention

    def recorded_forward(self, tokens, real=None, last_only=False, prompt_=False):
        inside.append(self.num_slots + tokens.shape[1] if prompt_ == prompt else None)
        try:
            return forward(self, tokens, real, last_only, prompt_)
        finally:
            inside.pop()

    def recording_sdpa(query, key, value, attn_mask=None, *args, is_causal=False, **kwargs):
        if inside and inside[-1] is not None:
            mask = None if attn_mask is None else tuple(attn_mask.shape)
            calls.append((inside[-1], query.shape[2], key.shape[2], mask, is_causal))
        return sdpa(query, key, value, attn_mask, *args, is_causal=is_causal, **kwargs)

    def eager_weights(module, args, kwargs, output):
        if inside and inside[-1] is not None and output[1] is not None:
            mask = kwargs["attention_mask"]
            calls.append((inside[-1], output[1].shape[2], output[1].shape[3], tuple(mask.shape), False))

    monkeypatch.setattr(StaticDecoderRunner, "forward", lambda self, tokens, real=None, last_only=False,
                        prompt=False: recorded_forward(self, tokens, real, last_only, prompt))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    for model in models:  # (the test's own models: the hooks stay on them; marked per-token: they only record)
        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(sk.per_token_hook(eager_weights), with_kwargs=True)
    return calls


CASES = [("sdpa", 1, None), ("sdpa", 3, None), ("sdpa", 1, 4), ("sdpa", 3, 4), ("eager", 1, None), ("eager", 3, None),
         ("sliding", 1, None)]


def _pair(attention):
    """(target, draft): Llamas under ``attention``, or Mistrals whose sliding window (4) binds over the prompt."""
    if attention == "sliding":
        config = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, sliding_window=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(5)
        target = MistralForCausalLM(MistralConfig(num_hidden_layers=2, **config)).eval()
        return target, MistralForCausalLM(MistralConfig(num_hidden_layers=1, **config)).eval()
    target, draft = llama(layers=2, seed=5), llama(layers=1, seed=6)
    for model in (target, draft):
        model.set_attn_implementation(attention)
    return target, draft


@pytest.mark.parametrize("attention,batch,chunk", CASES)
def test_prompt_forwards_attend_to_the_written_slots_only(attention, batch, chunk, monkeypatch):
    """Each prompt forward's attention reads keys [0, end) (end: the slots written by its end), not the C slots
    of the cache (the old [B, 1, T, C] mask: T * C writes and SDPA's masked kernel over every slot, ~3x
    model.generate's static prefill at T = 4000); an unpadded prompt's first forward has no mask and is causal
    under SDPA (with a sliding window, transformers masks it over the slots read). Tokens are model.generate's with
    the static cache."""
    target, draft = _pair(attention)
    ids, mask = _prompts(batch)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, prefill_chunk_size=chunk,
                  cache_implementation="static")
    expected = hf_generate(target, ids, **kwargs)
    calls = _record_attention(monkeypatch, (target, draft), prompt=True)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs)
    monkeypatch.undo()
    assert torch.equal(got, expected)
    assert len(calls) == 3 * (1 if chunk is None else 2)  # (2 + 1 layers; prompts of 8 slots: 1 or 2 chunks)
    for end, queries, keys, mask_shape, is_causal in calls:
        assert keys == end, (end, keys)
        if attention != "sdpa":  # (the mask transformers built: eager's, or the window's)
            assert mask_shape[-2:] == (queries, end)
        elif end == queries and batch == 1:  # an unpadded prompt's first forward
            assert mask_shape is None and is_causal
        else:
            assert mask_shape == (batch, 1, queries, end) and not is_causal


@pytest.mark.parametrize("attention,batch", [("sdpa", 1), ("sdpa", 3), ("eager", 3), ("sliding", 3)])
def test_draft_and_verification_forwards_attend_to_the_written_slots_only(attention, batch, monkeypatch):
    """The forwards after the prompt's (draft steps, verifications, a padded batch's fillers) are eager here too:
    each reads keys [0, end), with a mask over those slots, not all C slots of the cache (model.generate's static
    steps read all C: with many new tokens most of them unwritten). Tokens are model.generate's."""
    target, draft = _pair(attention)
    ids, mask = _prompts(batch)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static")
    expected = hf_generate(target, ids, **kwargs)
    calls = _record_attention(monkeypatch, (target, draft), prompt=False)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs)
    monkeypatch.undo()
    assert torch.equal(got, expected)
    assert len(calls) > 3 * 2  # (2 + 1 layers; drafts and verifications)
    for end, queries, keys, mask_shape, is_causal in calls:
        # (one-token steps: transformers packs GQA into the query axis, [B, H_kv, groups, D], beside a [.., 1, S] mask)
        assert keys == end and mask_shape[-1] == end and not is_causal, (end, keys, mask_shape)
