"""The minimum in the processors' config (``context_processors._processor_config``): two mutants (mutation round 4,
C1 and C2) passed every other test.

C1: min_new_tokens=0 beside a min_length: HF's _prepare_generated_length sets min_length = prompt + 0 (min_new_tokens
takes precedence), so EOS may come at once. Testing ``if config.min_new_tokens:`` instead of ``is not None`` kept the
caller's min_length in the processors' config, and HF's MinLengthLogitsProcessor held EOS back: other tokens,
silently; every test passed (none sets min_new_tokens=0 beside min_length).

C2: min_length one short (prompt + min_new_tokens - 1) is hidden by HF's MinNewTokensLengthLogitsProcessor, except
where a caller's MinNewTokensLengthLogitsProcessor replaces that one (the repo's test replaces the other,
MinLengthLogitsProcessor): then the processors' MinLength is what holds EOS back."""

import warnings

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

import speculative_kernels as sk
from helpers.models import hf_generate, llama

ONE = torch.tensor([[84, 39, 64, 30, 63, 11, 12]])
GREEDY = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _pair():
    return llama(), llama(layers=1, seed=3)


def test_min_new_tokens_zero_overrides_min_length():
    """(A processor setting, so that the rows' HF processor chain is built at all: without one the loop's own
    minimum, plan.min_new_tokens, is the only one.)"""
    target, draft = _pair()
    base = dict(GREEDY, repetition_penalty=1.3)
    new = hf_generate(target, ONE, **dict(base, max_new_tokens=8))[0, ONE.shape[1]:].tolist()
    eos = new[1]
    assert eos != new[0]
    kwargs = dict(base, eos_token_id=eos, min_new_tokens=0, min_length=ONE.shape[1] + 6)
    expected = _quiet(hf_generate, target, ONE, **kwargs)
    assert expected.shape[1] < ONE.shape[1] + 6  # HF stopped at the early EOS: min_length was overridden
    assert torch.equal(_quiet(sk.generate, target, ONE, draft_model=draft, **kwargs), expected)


def test_a_callers_min_new_tokens_processor_leaves_min_length_in_force():
    target, draft = _pair()
    new = hf_generate(target, ONE, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ONE.shape[1]:].tolist()
    eos = new[3]  # the fourth new token: where a minimum of 4 new tokens, one short, would let EOS through
    assert eos not in new[:3]
    mine = MinNewTokensLengthLogitsProcessor(ONE.shape[1], 1, eos)
    kwargs = dict(GREEDY, eos_token_id=eos, min_new_tokens=4, logits_processor=LogitsProcessorList([mine]))
    expected = _quiet(hf_generate, target, ONE, **kwargs)
    assert eos not in expected[0, ONE.shape[1]:ONE.shape[1] + 4].tolist()
    assert torch.equal(_quiet(sk.generate, target, ONE, draft_model=draft, **kwargs), expected)
