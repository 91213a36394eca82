"""The dynamo options of the captured steps (``generation/dynamo_options.py``) under torch versions that name them
otherwise or lack them: an option the tokens depend on refuses ``compile=`` before anything is compiled; a missing
performance option is logged, and the tokens stay the eager static path's.

A torch lacking an option is simulated by deleting it from ``torch._dynamo.config`` where torch itself does not read
it before the refusal, and otherwise by renaming the option on our side (torch must keep its own to run)."""

import dataclasses
import logging
import types

import pytest
import torch

import speculative_kernels as sk
from speculative_kernels import CompileOptions
from speculative_kernels.generation import dynamo_options
from helpers.models import llama

TRACE_ONLY = CompileOptions(backend="aot_eager")
GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def pair():
    return llama(), llama(layers=1, seed=1)


def _prompt():
    return torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(0))


def _compile_forbidden(*args, **kwargs):
    raise AssertionError("torch.compile was called before the refusal")


@pytest.mark.parametrize("entry", ["generate", "SpeculativeDecoder.start", "SpeculativeDecoder(compile=)"])
def test_compile_is_refused_where_torch_lacks_the_hook_guards_option(pair, monkeypatch, entry):
    """Without skip_nnmodule_hook_guards the captured steps would not guard on forward hooks (a hook registered after
    capture left out of the reused steps, silently): the option used to be skipped where missing; now compile= is
    refused by name, before anything is compiled, at each entry point."""
    target, draft = pair
    monkeypatch.delattr(torch._dynamo.config, "skip_nnmodule_hook_guards")
    monkeypatch.setattr(torch, "compile", _compile_forbidden)
    expected = f"compile=True needs torch._dynamo.config.skip_nnmodule_hook_guards, which torch {torch.__version__}"
    with pytest.raises(ValueError, match=expected.replace("+", r"\+")):
        if entry == "generate":
            sk.generate(target, _prompt(), draft_model=draft, num_speculative_tokens=2, compile=TRACE_ONLY, **GREEDY)
        elif entry == "SpeculativeDecoder.start":
            sk.SpeculativeDecoder(target, draft, num_speculative_tokens=2).start(_prompt(), compile=True, **GREEDY)
        else:
            sk.SpeculativeDecoder(target, draft, num_speculative_tokens=2, cache_implementation="static",
                                  max_context=32, compile=TRACE_ONLY)


def test_each_torch_versions_names_are_set(caplog):
    """torch 2.6 names the limit options cache_size_limit / fail_on_cache_limit_hit (2.7 to 2.15:
    recompile_limit / fail_on_recompile_limit_hit, the old names aliases): both were skipped on 2.6, leaving dynamo's
    limit at 8 and its silent eager fallback past it. A torch with neither name of the limit gets a logged reason."""
    torch_2_6 = types.SimpleNamespace(cache_size_limit=8, fail_on_cache_limit_hit=False,
                                      skip_nnmodule_hook_guards=True)
    assert dynamo_options.dynamo_settings(torch_2_6) == {
        "skip_nnmodule_hook_guards": False, "cache_size_limit": 64, "fail_on_cache_limit_hit": True}
    assert dynamo_options.dynamo_settings() == {  # the installed torch's own names, newest first
        "skip_nnmodule_hook_guards": False, "recompile_limit": 64, "fail_on_recompile_limit_hit": True}
    with pytest.raises(ValueError, match="skip_nnmodule_hook_guards"):
        dynamo_options.dynamo_settings(types.SimpleNamespace(recompile_limit=8, fail_on_recompile_limit_hit=False))
    dynamo_options._log_missing.cache_clear()
    with caplog.at_level(logging.WARNING, logger="speculative_kernels"):
        no_limit = dynamo_options.dynamo_settings(types.SimpleNamespace(skip_nnmodule_hook_guards=True,
                                                                        fail_on_recompile_limit_hit=False))
    assert no_limit == {"skip_nnmodule_hook_guards": False, "fail_on_recompile_limit_hit": True}
    assert "recompile_limit / cache_size_limit: dynamo's own limit of compiled shapes" in caplog.text


def test_without_failing_past_the_limit_the_steps_run_eagerly_with_the_same_tokens(pair, monkeypatch, caplog):
    """A torch without fail_on_recompile_limit_hit (by either name) runs the captured steps eagerly past dynamo's
    limit: the tokens stay model.generate's (only speed is lost), and the missing option is logged, once. A limit
    of 0 hits it at the first step; with the option the same call stops with the RuntimeError (so the limit is hit)."""
    target, draft = pair
    ids = _prompt()
    expected = target.generate(ids, **GREEDY)
    at_once = dataclasses.replace(dynamo_options.RECOMPILE_LIMIT, value=0)
    renamed = dataclasses.replace(dynamo_options.FAIL_PAST_LIMIT, names=("a_later_torchs_name",))

    def ours():
        return sk.generate(target, ids, draft_model=draft, num_speculative_tokens=2, compile=TRACE_ONLY, **GREEDY)

    failing = (dynamo_options.HOOK_GUARDS, at_once, dynamo_options.FAIL_PAST_LIMIT)
    monkeypatch.setattr(dynamo_options, "OPTIONS", failing)
    try:
        with pytest.raises(RuntimeError, match="compiled the captured decoding steps for 0 shapes already"):
            ours()
        monkeypatch.setattr(dynamo_options, "OPTIONS", (dynamo_options.HOOK_GUARDS, at_once, renamed))
        dynamo_options._log_missing.cache_clear()
        with caplog.at_level(logging.WARNING, logger="speculative_kernels"):
            assert torch.equal(ours(), expected)
            assert torch.equal(ours(), expected)
    finally:
        torch._dynamo.reset()  # dynamo marks a step's code run-eagerly-only past the limit, for every later test too
    missing = [r.getMessage() for r in caplog.records if "a_later_torchs_name" in r.getMessage()]
    assert len(missing) == 1 and "run eagerly (the same tokens, slower)" in missing[0], caplog.text
