"""No attention_mask given: as HF, a decoder-only prompt's padding is inferred from pad_token_id
(``_prepare_attention_mask_for_generation``): when the pad id is not an EOS id and occurs in input_ids, those
positions are masked (encoder-decoder inputs are not, as in HF). Every path of ours sees the
same mask HF's ``generate`` would build, or refuses by name where that mask is right padding."""

import pytest
import torch

import speculative_kernels as sk
from helpers.models import hf_generate, llama
from helpers.seq2seq_models import source_batch, t5


@pytest.fixture(scope="module")
def pair():
    return llama(), llama(layers=1, seed=3)


@pytest.mark.parametrize("ids", [
    [[0, 17, 42, 70, 7]],                      # a leading pad id (e.g. a tokenizer whose BOS is its pad)
    [[5, 17, 0, 70, 7, 9]],                    # a pad id inside the prompt
    [[0, 0, 17, 42, 70, 7], [3, 8, 17, 0, 70, 7]],  # left padding without a mask, and a hole
])
@pytest.mark.parametrize("drafting", ["draft_model", "prompt_lookup"])
def test_mask_inferred_from_pad_token_as_inhf_generate(pair, ids, drafting):
    target, draft = pair
    ids = torch.tensor(ids)
    expected = hf_generate(target, ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    plain = hf_generate(target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                pad_token_id=0)
    assert not torch.equal(expected, plain)  # the inferred mask changes HF's output: the test can fail
    extra = dict(draft_model=draft, num_speculative_tokens=3) if drafting == "draft_model" else dict(
        prompt_lookup_num_tokens=3)
    got = sk.generate(target, ids, max_new_tokens=12, do_sample=False, pad_token_id=0, **extra)
    assert torch.equal(got, expected)


def test_no_inference_when_pad_is_an_eos_id(pair):
    target, draft = pair
    ids = torch.tensor([[2, 17, 42, 70, 7]])  # eos_token_id is 2
    expected = hf_generate(target, ids, max_new_tokens=10, do_sample=False, pad_token_id=2, eos_token_id=2)
    got = sk.generate(target, ids, draft_model=draft, max_new_tokens=10, do_sample=False, pad_token_id=2,
                      eos_token_id=2)
    assert torch.equal(got, expected)


def test_a_trailing_pad_id_is_refused_by_name(pair):
    target, draft = pair
    with pytest.raises(ValueError, match=r"ends with pad_token_id=0 in batch rows \[0\]"):
        sk.generate(target, torch.tensor([[5, 17, 42, 0]]), draft_model=draft, max_new_tokens=4, pad_token_id=0)


def test_encoder_decoder_input_is_not_masked_by_pad_id_as_inhf_generate():
    """transformers (5.17-5.23) infers the mask for decoder-only models only: a T5 input holding pad ids without a
    mask runs unmasked there, and so here."""
    target, draft = t5(), t5(layers=1, seed=3)
    ids, mask = source_batch([12, 3, 5], seed=0)  # right-padded with pad id 0, no mask passed
    expected = hf_generate(target, ids, max_new_tokens=8, do_sample=False)
    masked = hf_generate(target, ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert not torch.equal(expected, masked)  # inferring the mask here would change the output: the test can fail
    got = sk.generate(target, ids, draft_model=draft, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


def test_a_pad_token_id_that_is_an_eos_id_infers_no_padding():
    """HF's _prepare_attention_mask_for_generation: pad_token_id among the EOS ids -> the mask is all ones, so an
    EOS/pad id inside the prompt is attended to (inferring a mask from it gave other tokens)."""
    target, draft = llama(), llama(layers=1, seed=3)
    ids = torch.tensor([[2, 40, 41, 2, 42, 43]])
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=2)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, **kwargs), hf_generate(target, ids, **kwargs))
