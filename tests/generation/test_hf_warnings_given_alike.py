"""(Mutation round 4: mutants S4, S5, S8, S9, S10, R1, R2 passed every other test.) model.generate's warnings, given by ours, where HF gives none or gives
one the repo's test_hfs_warnings_are_given does not try: a minimum exactly at the maximum (HF warns only above it),
one prompt or no EOS id without a mask (HF's batch warnings need both), a pad id that is the EOS id in a batch, a
caller's EosTokenCriteria without an EOS id or a subclass of MaxLengthCriteria (HF warns only for the very types it
builds), a caller's MaxTimeCriteria beside max_time. The comparison is test_contract's: the lines HF's logger and
``warnings`` carry, both sides alike (an empty list included)."""

import io
import logging
import warnings

import pytest
import torch
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StoppingCriteriaList)
from transformers.utils import logging as hf_logging

import speculative_kernels as sk
from helpers.models import llama


class _Longest(MaxLengthCriteria):
    """A caller's subclass: not the type model.generate builds, so no replacement and no warning."""


CASES = {
    "min_length at max": dict(max_new_tokens=3, min_length=8),  # prompt 5 + 3 = 8: not above it
    "min_new_tokens at max": dict(max_new_tokens=3, min_new_tokens=3),
    "one row without mask or pad": dict(max_new_tokens=3, pad_token_id=None),
    "batch without mask, pad or eos": dict(max_new_tokens=3, pad_token_id=None, eos_token_id=None),
    "batch without mask, pad is eos": dict(max_new_tokens=3, pad_token_id=2, eos_token_id=2),
    "EosTokenCriteria without eos": dict(max_new_tokens=4, eos_token_id=None,
                                         stopping_criteria=StoppingCriteriaList([EosTokenCriteria(5)])),
    "MaxTimeCriteria with max_time": dict(max_new_tokens=4, max_time=100.0,
                                          stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(100.0)])),
    "MaxLengthCriteria subclass": dict(max_new_tokens=6, stopping_criteria=StoppingCriteriaList([_Longest(8)])),
}
BATCHED = {"batch without mask, pad or eos", "batch without mask, pad is eos"}


def _given(call):
    logger = hf_logging.get_logger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.warning_once.cache_clear()  # (each side its own first warning)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        logger.removeHandler(handler)
    lines = [str(w.message) for w in caught] + stream.getvalue().splitlines()
    words = ("length", "attention mask", "custom", "deprecated")
    return sorted(line for line in lines if any(word in line for word in words))


@pytest.mark.parametrize("case", sorted(CASES))
def test_warnings_where_hf_gives_none_or_one_untested(case):
    target = llama()
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]) if case in BATCHED else torch.tensor([[5, 6, 7, 8, 9]])
    kwargs = CASES[case]
    expected = _given(lambda: target.generate(ids, do_sample=False, **kwargs))
    got = _given(lambda: sk.generate(target, ids, draft_model=target, num_speculative_tokens=3, do_sample=False,
                                     **kwargs))
    assert got == expected
