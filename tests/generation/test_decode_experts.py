"""The experts implementation the forwards run with, as model.generate switches it after its prefill.

transformers' generate runs the forwards after the prefill inside ``model._optimize_model_for_decode()`` (on a GPU, an
MoE model's ``grouped_mm`` experts decode as ``batched_mm``). On the CPU that switch does nothing, so these tests
replace it by one that always switches, the same for HF and for us, and compare like with like.
"""

import contextlib

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.generation.utils import GenerationMixin

import speculative_kernels as sk
from helpers.models import SPECIAL, llama


@pytest.fixture
def switch_log(monkeypatch):
    """Replace transformers' decode-time switch by one that marks the model (``_decoding``) and, for an MoE model,
    switches grouped_mm to batched_mm as transformers does on a GPU. Returns the list of models it was entered for."""
    entered = []

    @contextlib.contextmanager
    def optimize_for_decode(self):
        entered.append(self)
        original = self.get_experts_implementation()
        self._decoding = True
        switch = "grouped_mm" in original.values()
        if switch:
            self.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in original.items()})
        try:
            yield
        finally:
            self._decoding = False
            if switch:
                self.set_experts_implementation(original)

    monkeypatch.setattr(GenerationMixin, "_optimize_model_for_decode", optimize_for_decode)
    return entered


def _record(model):
    """Per forward of ``model``: (tokens per row, whether inside the decode switch, experts implementation)."""
    calls = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append((ids.shape[1], getattr(module, "_decoding", False), module.config._experts_implementation))

    model.register_forward_pre_hook(sk.per_token_hook(hook), with_kwargs=True)
    return calls


def _mixtral(seed=0):
    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=512, **SPECIAL)
    return MixtralForCausalLM(config).eval()


PROMPT = torch.tensor([[5, 9, 14, 3, 22, 41, 7]])


def test_prefill_outside_every_later_forward_inside_as_model_generate(switch_log):
    target, draft = llama(), llama(layers=1, seed=2)
    hf_calls = _record(target)
    expected = target.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert [inside for _, inside, _ in hf_calls] == [False] + [True] * (len(hf_calls) - 1)  # what HF does
    hf_calls.clear()
    draft_calls = _record(draft)
    switch_log.clear()
    out = sk.generate(target, PROMPT, draft_model=draft, max_new_tokens=12, do_sample=False, pad_token_id=0,
                      num_speculative_tokens=3)
    assert torch.equal(out, expected)
    for calls in (hf_calls, draft_calls):  # the prompt's forward outside, every draft and verify forward inside
        assert calls[0][0] == PROMPT.shape[1] - 1 and not calls[0][1]
        assert all(inside for _, inside, _ in calls[1:]) and len(calls) > 2
    assert sorted(map(id, switch_log)) == sorted([id(target), id(draft)])  # switched once each, as HF's generate
    assert not target._decoding and not draft._decoding  # left as they were


def test_decoder_steps_leave_the_models_as_they_were(switch_log):
    target, draft = llama(), llama(layers=1, seed=2)
    calls = _record(target)
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        PROMPT, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert len(calls) == 1 and not calls[0][1]  # the prefill
    while not session.finished:
        session.step()
        assert not target._decoding and not draft._decoding  # between steps the server's models are its own
    assert all(inside for _, inside, _ in calls[1:]) and len(calls) > 2


def test_a_joining_request_is_prefilled_outside(switch_log):
    target, draft = llama(), llama(layers=1, seed=2)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    calls = _record(target)
    first = decoder.add_request(PROMPT[0], max_new_tokens=12, do_sample=False)
    decoder.step()
    decoder.step()
    joined_at = len(calls)
    second = decoder.add_request(PROMPT[0, 2:], max_new_tokens=6, do_sample=False)
    while decoder.running:
        decoder.step()
    prefills = [c for c in calls if not c[1]]
    assert len(prefills) == 2 and any(not inside for _, inside, _ in calls[joined_at:])
    for request, prompt, n in ((first, PROMPT, 12), (second, PROMPT[:, 2:], 6)):
        expected = target.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert decoder.result(request).token_ids == expected[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_moe_decodes_with_the_implementation_model_generate_switches_to(switch_log, cache):
    """Mixtral decodes with batched_mm where transformers' switch says so, its prefill with grouped_mm: tokens equal
    model.generate under the same switch, and the model's own setting is back afterwards."""
    target, draft = _mixtral(), _mixtral(seed=3)
    if target.get_experts_implementation()[""] != "grouped_mm":
        pytest.skip("this torch/transformers runs Mixtral's experts without grouped_mm")
    expected = target.generate(PROMPT, max_new_tokens=10, do_sample=False, pad_token_id=0)
    calls = _record(target)
    out = sk.generate(target, PROMPT, draft_model=draft, max_new_tokens=10, do_sample=False, pad_token_id=0,
                      num_speculative_tokens=3, cache_implementation=cache)
    assert torch.equal(out, expected)
    assert calls[0][2] == "grouped_mm" and {impl for _, _, impl in calls[1:]} == {"batched_mm"}
    assert target.get_experts_implementation() == {"": "grouped_mm"}
    assert draft.get_experts_implementation() == {"": "grouped_mm"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: transformers' switch acts on a GPU only")
def test_moe_on_cuda_decodes_with_transformers_own_switch():
    """On a GPU, unpatched: the prefill with the model's grouped_mm, every later forward with what transformers'
    switch picks (batched_mm in 5.17-5.24), as model.generate; float32 tokens equal, the setting restored."""
    target, draft = _mixtral().cuda(), _mixtral(seed=3).cuda()
    prompt = PROMPT.cuda()
    own = target.get_experts_implementation()
    expected = target.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    hf_calls = _record(target)
    target.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    hf_decode = {impl for _, _, impl in hf_calls[1:]}
    hf_calls.clear()
    out = sk.generate(target, prompt, draft_model=draft, max_new_tokens=16, do_sample=False, pad_token_id=0,
                      num_speculative_tokens=3)
    assert torch.equal(out, expected)
    assert hf_calls[0][2] == own[""] and {impl for _, _, impl in hf_calls[1:]} == hf_decode
    assert target.get_experts_implementation() == own


@pytest.mark.parametrize("cache", [None, "static"])
def test_a_config_with_output_router_logits_true_generates_model_generates_tokens(cache):
    """An MoE config.json with ``output_router_logits: true`` (a training run's load-balancing loss, kept by
    fine-tuning scripts): model.generate runs without an attention_mask (its one-token steps' 2-D mask broadcasts in
    the loss; with a mask it fails inside transformers too), ours crashed inside transformers on every call (the
    loss multiplied the router weights of a multi-token forward by a mask over the cache's slots). The runners pass
    output_router_logits=False (the router logits feed only that loss, never the logits): the tokens of
    model.generate with the flag off, batch 1 and a left-padded batch, target and draft both so configured."""
    target, draft = _mixtral(), _mixtral(seed=3)
    ids = torch.tensor([[5, 9, 14, 3, 22, 41, 7], [0, 0, 0, 8, 30, 12, 19]])
    mask = (ids != 0).long()
    expected = [target.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=10, do_sample=False,
                                pad_token_id=0) for rows in (slice(0, 1), slice(0, 2))]
    for model in (target, draft):
        model.config.output_router_logits = True
    assert torch.equal(target.generate(ids[:1], max_new_tokens=10, do_sample=False, pad_token_id=0), expected[0])
    for rows, tokens in zip((slice(0, 1), slice(0, 2)), expected):
        out = sk.generate(target, ids[rows], attention_mask=mask[rows], draft_model=draft, max_new_tokens=10,
                          do_sample=False, pad_token_id=0, num_speculative_tokens=3, cache_implementation=cache)
        assert torch.equal(out, tokens), rows
