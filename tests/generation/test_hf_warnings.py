"""model.generate's warnings, given by ours with its texts, through its loggers and ``warnings`` as it gives them (from
its module, file and line), where it gives them and nowhere else: the lengths (both forms of a limit; a minimum
above the maximum; the model-agnostic default), a batch without attention_mask or pad_token_id, a caller's criterion
replacing its own, a deprecated cache name, the reminder past max_position_embeddings. Each compares the lines HF's
loggers and ``warnings`` carry during the call on both sides, an empty list included."""

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


@pytest.mark.parametrize("case", ["max both", "min both", "min_length over max", "min_new_tokens over max",
                                  "batch without mask or pad", "custom MaxLengthCriteria", "deprecated cache name",
                                  "past max_position_embeddings"])
def test_hfs_warnings_are_given(case):
    """model.generate's warnings about the lengths (both forms of a limit set; a minimum above the maximum), a batch
    without attention_mask (and pad_token_id), a caller's criterion replacing its own and a deprecated cache name are
    given with its texts, and so is the reminder past max_position_embeddings,
    through its logger or warnings as it gives them (they were dropped)."""
    target = llama()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    kwargs = {"max both": dict(max_new_tokens=4, max_length=30),
              "min both": dict(max_new_tokens=4, min_new_tokens=1, min_length=12),
              "min_length over max": dict(max_new_tokens=3, min_length=30),
              "min_new_tokens over max": dict(max_new_tokens=3, min_new_tokens=30),
              "batch without mask or pad": dict(max_new_tokens=3, pad_token_id=None),
              "custom MaxLengthCriteria": dict(max_new_tokens=6,
                                               stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(8)])),
              "deprecated cache name": dict(max_new_tokens=3, cache_implementation="sliding_window"),
              "past max_position_embeddings": dict(max_new_tokens=6)}[case]
    if case == "batch without mask or pad":
        ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    if case == "past max_position_embeddings":  # (a rotary model: the config's number is only a reminder)
        target.config.max_position_embeddings = 8
    expected = _hf_warnings(lambda: target.generate(ids, do_sample=False, **kwargs))
    assert expected
    assert _hf_warnings(lambda: sk.generate(target, ids, draft_model=target, num_speculative_tokens=3,
                                            do_sample=False, **kwargs)) == expected


def test_hfs_reminder_past_max_position_embeddings_is_given_where_hfs_is():
    """HF's MaxLengthCriteria reminds (once per process) when a sequence grows past config.max_position_embeddings
    before max_length: at each length L it checks L > max_position_embeddings and L < max_length. Ours gives it for
    the same limits, after EOS too (its length is where the sequence ended), with a DecodeSession's steps, and not
    where a caller's MaxLengthCriteria replaces HF's (whose own fields then decide)."""
    target, draft = llama(), llama(layers=1, seed=2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=8)
    eos = int(plain[0, 5 + 3])  # the fourth new token: an EOS there ends the sequence at length 9

    def reminded(call) -> bool:
        return any("friendly reminder" in line for line in _hf_warnings(call))

    seen = set()
    for limit in range(3, 15):
        for kwargs in (dict(max_new_tokens=1), dict(max_new_tokens=6), dict(max_new_tokens=8, eos_token_id=eos),
                       dict(max_new_tokens=8, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(11)]))):
            target.config.max_position_embeddings = limit
            expected = reminded(lambda: target.generate(ids, do_sample=False, **kwargs))
            assert reminded(lambda: sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3,
                                                do_sample=False, **kwargs)) == expected, (limit, kwargs)
            seen.add(expected)
    assert seen == {True, False}
    target.config.max_position_embeddings = 8

    def session():
        run = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(ids, max_new_tokens=6)
        while not run.finished:
            run.step()

    assert reminded(session)


def test_an_encoder_decoders_copies_of_one_prompt_get_no_batch_warning():
    """num_return_sequences=2 of one source prompt without attention_mask or pad_token_id: model.generate tests the
    batch size before repeating the rows (one: no warning); ours repeated the encoder input first and warned as for
    a batch of two. A batch of two sources is warned about by both."""
    from helpers.seq2seq_models import t5

    model = t5()
    kwargs = dict(max_new_tokens=4, do_sample=True, top_k=1, pad_token_id=None)
    for source, copies in ((torch.tensor([[5, 6, 7, 8, 9]]), 2), (torch.tensor([[5, 6, 7], [8, 9, 10]]), 1)):
        expected = _hf_warnings(lambda: model.generate(source, num_return_sequences=copies, **kwargs))
        assert bool(expected) == (source.shape[0] > 1)
        assert _hf_warnings(lambda: sk.generate(model, source, draft_model=model, num_speculative_tokens=2, seed=0,
                                                num_return_sequences=copies, **kwargs)) == expected


def _hf_warnings(call) -> list[str]:
    """The lines model.generate's length, mask, criteria and cache warnings give during call(), through transformers'
    loggers and ``warnings`` (each side's first warning_once: its cache is cleared)."""
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


def test_hfs_length_warnings_come_from_its_module():
    """model.generate's length warnings (``warnings.warn`` in transformers.generation.utils) are ours with its module,
    file and line: a filter keyed on transformers' module (``filterwarnings("ignore", module="transformers")``, a
    common way to quiet it) silenced HF's and not ours, which were attributed to the caller's line."""
    target = llama()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    calls = [dict(min_length=30, max_new_tokens=3), dict(min_new_tokens=9, max_new_tokens=3), dict()]

    def caught(call, **filters):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if filters:
                warnings.filterwarnings("ignore", **filters)
            call()
        return sorted((w.filename, w.lineno, str(w.message)) for w in seen if "length" in str(w.message))

    for kwargs in calls:
        expected = caught(lambda: target.generate(ids, do_sample=False, **kwargs))
        assert expected and all(filename.endswith("generation/utils.py") for filename, _, _ in expected)
        assert caught(lambda: sk.generate(target, ids, draft_model=target, do_sample=False, **kwargs)) == expected
        assert caught(lambda: sk.generate(target, ids, draft_model=target, do_sample=False, **kwargs),
                      module="transformers") == [] == caught(lambda: target.generate(ids, do_sample=False, **kwargs),
                                                              module="transformers")


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


@pytest.mark.parametrize("case", sorted(CASES))
def test_warnings_where_hf_gives_none_or_one_untested(case):
    """A minimum exactly at the maximum (HF warns only above it), one prompt or no EOS id without a mask (HF's batch
    warnings need both), a pad id that is the EOS id in a batch, a caller's EosTokenCriteria without an EOS id or a
    subclass of MaxLengthCriteria (HF warns only for the very types it builds), a caller's MaxTimeCriteria beside
    max_time (mutation round 4: warnings given where HF gives none passed every other test)."""
    target = llama()
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]) if case in BATCHED else torch.tensor([[5, 6, 7, 8, 9]])
    kwargs = CASES[case]
    expected = _hf_warnings(lambda: target.generate(ids, do_sample=False, **kwargs))
    got = _hf_warnings(lambda: sk.generate(target, ids, draft_model=target, num_speculative_tokens=3, do_sample=False,
                                     **kwargs))
    assert got == expected
