"""stop_strings per request in continuous batching, on the demo pair (which has a tokenizer): each request stops
where model.generate(stop_strings=..., tokenizer=...) stops it alone, with finish_reason "stop"; a batch-mate without
stop strings runs on."""

import pytest
import torch

import speculative_kernels as sk
from speculative_kernels.demo_pair import load_demo_pair


@pytest.fixture(scope="module")
def demo():
    return load_demo_pair()


def test_stop_strings_per_request(demo):
    target, draft, tokenizer = demo
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=4, tokenizer=tokenizer)
    cases = [("def add(a, b):", dict(max_new_tokens=40, stop_strings=["\n"])),
             ("import os\nimport", dict(max_new_tokens=40, stop_strings=["sys", "\n\n"])),
             ("for i in range(", dict(max_new_tokens=12))]
    ids = {}
    for prompt, settings in cases:
        ids[decoder.add_request(tokenizer(prompt)["input_ids"], do_sample=False, **settings)] = (prompt, settings)
        decoder.step()
    while decoder.has_work():
        decoder.step()
    reasons = []
    for request_id, (prompt, settings) in ids.items():
        prompt_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        extra = {"tokenizer": tokenizer} if "stop_strings" in settings else {}
        expected = target.generate(prompt_ids, do_sample=False, **settings, **extra)[0, prompt_ids.shape[1]:]
        expected = expected[expected != tokenizer.pad_token_id].tolist()
        result = decoder.result(request_id)
        assert result.token_ids == expected, prompt
        reasons.append(result.finish_reason)
        # the drafts it kept: its tokens less one per step (each step's last token is the target's); the drafts
        # after a stop string were counted as accepted
        assert result.accepted_tokens == len(result.token_ids) - result.iterations <= result.drafted_tokens, prompt
    assert reasons[0] == "stop" and reasons[2] in ("length", "eos")


def test_stop_strings_are_checked(demo):
    target, draft, tokenizer = demo
    with pytest.raises(ValueError, match="stop_strings needs the decoder's tokenizer"):
        sk.SpeculativeDecoder(target, draft).add_request([1, 2], stop_strings=["x"])
    decoder = sk.SpeculativeDecoder(target, draft, tokenizer=tokenizer)
    for bad in ([], [""], [3], 5):
        with pytest.raises(TypeError, match="stop_strings must be"):
            decoder.add_request([1, 2], stop_strings=bad)


def test_generate_stop_strings_per_row_as_model_generate(demo):
    """generate(stop_strings=..., tokenizer=...): each row stops after the token completing a stop string (kept),
    its later positions padded, the other rows run on: token-identical to model.generate, batch 1 and a
    left-padded batch, draft model and prompt lookup; the model's generation_config default applies too."""
    target, draft, tokenizer = demo
    prompts = ["def add(a, b):", "import os\nimport", "for i in range(", "class Stack:\n    def"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=40, do_sample=False, stop_strings=["\n", "sys"], tokenizer=tokenizer,
                  pad_token_id=tokenizer.pad_token_id)
    expected = target.generate(**batch, **kwargs)
    plain = target.generate(**batch, **{k: v for k, v in kwargs.items() if k not in ("stop_strings", "tokenizer")})
    assert not torch.equal(expected, plain[:, : expected.shape[1]])  # the stops cut rows: the test can fail
    for extra in (dict(draft_model=draft, num_speculative_tokens=4), dict(prompt_lookup_num_tokens=4)):
        assert torch.equal(sk.generate(target, **batch, **kwargs, **extra), expected)
        one = tokenizer(prompts[:1], return_tensors="pt")
        assert torch.equal(sk.generate(target, **one, **kwargs, **extra), target.generate(**one, **kwargs))
    with pytest.raises(ValueError, match="stop_strings=.* needs tokenizer="):
        sk.generate(target, **batch, draft_model=draft, max_new_tokens=4, stop_strings=["\n"])
    with pytest.raises(TypeError, match="stop_strings must be"):
        sk.generate(target, **batch, draft_model=draft, max_new_tokens=4, stop_strings=[3], tokenizer=tokenizer)
    config_default = dict(kwargs)
    del config_default["stop_strings"]
    target.generation_config.stop_strings = ["\n"]
    try:
        assert torch.equal(sk.generate(target, **batch, draft_model=draft, **config_default),
                           target.generate(**batch, **config_default))
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=4, tokenizer=tokenizer)
        request = decoder.add_request(tokenizer(prompts[0])["input_ids"], max_new_tokens=40, do_sample=False)
        # an explicit stop_strings=None turns the default off, as model.generate's does (add_request applied it)
        off = decoder.add_request(tokenizer(prompts[0])["input_ids"], max_new_tokens=6, do_sample=False,
                                  stop_strings=None)
        while decoder.has_work():
            decoder.step()
        assert decoder.result(request).finish_reason == "stop"
        one = tokenizer(prompts[:1], return_tensors="pt")
        unstopped = target.generate(**one, **{**config_default, "max_new_tokens": 6}, stop_strings=None)
        unstopped = unstopped[0, one["input_ids"].shape[1]:]
        assert decoder.result(off).token_ids == unstopped.tolist() != decoder.result(request).token_ids
    finally:
        target.generation_config.stop_strings = None


def test_random_stop_strings_as_model_generate(demo):
    """Random stop strings cut from model.generate's own continuation, at any character (inside tokens, across
    them, several at once), batch 1 to 3: ours equals model.generate (draft model and prompt lookup). More seeds:
    ``cd tests && python -m helpers.stop_strings_differential 0 100``."""
    from helpers.stop_strings_differential import check_case, random_case

    target, draft, tokenizer = demo
    tokenizer.padding_side = "left"
    cut = [check_case(random_case(seed, tokenizer, target), target, draft, tokenizer) for seed in range(6)]
    assert all(cut)  # every case's stop strings cut a row: the comparison can fail


def test_request_counts_no_draft_after_its_stop_string(demo):
    """The target as its own draft accepts every draft: a stop string completed inside a block drops the accepted
    drafts after it, which are not kept drafts (they were counted: the cut came after the count)."""
    target, _, tokenizer = demo
    decoder = sk.SpeculativeDecoder(target, target, num_speculative_tokens=4, tokenizer=tokenizer)
    ids = [decoder.add_request(tokenizer(prompt)["input_ids"], do_sample=False, max_new_tokens=40,
                               stop_strings=["\n"])
           for prompt in ("def add(a, b):", "import os\nimport", "class Stack:\n    def")]
    while decoder.has_work():
        decoder.step()
    results = [decoder.result(i) for i in ids]
    assert all(r.finish_reason == "stop" for r in results)
    for r in results:
        assert r.accepted_tokens == len(r.token_ids) - r.iterations <= r.drafted_tokens


def test_a_callers_stop_string_or_max_time_criterion_replaces_the_builtin_one(demo):
    """HF's _merge_criteria_processor_list: a StopStringCriteria (MaxTimeCriteria) in stopping_criteria replaces the
    one generate builds from stop_strings (max_time). Ours ran both, so it stopped at the call's (or checkpoint's)
    stop string, or after max_time, where model.generate ran on: silently fewer tokens, in generate and start()."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StopStringCriteria

    target, draft, tokenizer = demo
    ids = tokenizer("def fib(n):", return_tensors="pt").input_ids
    own = StoppingCriteriaList([StopStringCriteria(tokenizer, ["bits"])])
    cases = [dict(stop_strings=["list"], stopping_criteria=own, tokenizer=tokenizer),
             dict(max_time=0.0, stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(max_time=600.0)]))]
    for extra in cases:
        kwargs = dict(max_new_tokens=24, do_sample=False, **extra)
        expected = target.generate(ids, **kwargs)
        builtin = {k: v for k, v in kwargs.items() if k != "stopping_criteria"}
        assert expected.shape[1] > target.generate(ids, **builtin).shape[1]  # the built-in one stops earlier
        assert torch.equal(sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, **kwargs), expected)
        tokenizer_argument = kwargs.pop("tokenizer", None)  # (a decoder's setting)
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=4, tokenizer=tokenizer_argument)
        session = decoder.start(ids, **kwargs)
        while not session.finished:
            session.step()
        assert torch.equal(session.sequences(), expected)
