"""Models whose code is not transformers' (``capabilities._own_forward``, ``_own_mask_code``,
``_own_forward_contract_reason``, ``_custom_step_reason``): the cases test_custom_models.py leaves open, each failing
on a mutant of those checks that it let through (mutation round 5)."""

import pytest
import torch
from transformers import LlamaForCausalLM, MistralForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaModel
from transformers.models.mistral.modeling_mistral import MistralModel

import speculative_kernels as sk
from speculative_kernels.generation.capabilities import check_model
from helpers.models import decoder_only_families, hf_generate, llama
from helpers.prompts import left_padded

# The KV cache keyword of this transformers version's forwards (``cache`` from 5.24, ``past_key_values`` before).
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _check_exact(target, ids, mask, new: int = 12, **settings):
    settings = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, **settings)
    expected = hf_generate(target, ids, attention_mask=mask, **settings)
    out = sk.generate(target, ids, attention_mask=mask, draft_model=llama(layers=1, seed=3), num_speculative_tokens=3,
                      **settings)
    assert torch.equal(out, expected)


class BiasedMistral(MistralForCausalLM):
    """A user's subclass of a sliding-window model whose forward adds a bias to the logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + self.logit_bias
        return out


class NamedMistralModel(MistralModel):
    """A user's subclass of the decoder stack with no forward of its own (a helper method added)."""

    def describe(self) -> str:
        return f"{len(self.layers)} layers"


@pytest.mark.parametrize("subclass", ["causal_lm_forward", "decoder_stack_without_forward"])
def test_sliding_window_subclass_keeps_4d_masks(subclass):
    """Only a decoder stack whose forward is not transformers' is given the 2-D mask (and refused with sliding
    windows, which come through 4-D masks): a subclass of the LM head model overriding forward, or of the decoder
    stack without a forward, still runs transformers' mask code, windows included, exactly in a padded batch."""
    target = decoder_only_families()["mistral"](layers=2)
    if subclass == "causal_lm_forward":
        target.__class__ = BiasedMistral
        target.logit_bias = torch.zeros(target.config.vocab_size)
        target.logit_bias[[5, 7, 11]] = 2.0
    else:
        target.model.__class__ = NamedMistralModel
    assert check_model(target, batch=2).mask == "4d"
    ids, mask = left_padded([11, 7])  # (longer than the window of 4)
    _check_exact(target, ids, mask, new=14)


class ForwardingLlamaModel(LlamaModel):
    """A user's decoder stack that wraps transformers' forward (it takes what the parent takes)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def test_own_decoder_stack_taking_4d_masks_runs_on_the_static_cache():
    """The 2-D mask is for an own decoder stack on the dynamic cache; on the static cache it is given the runner's
    4-D masks, which a stack that passes them to transformers' code takes: exact in a padded batch, not refused."""
    target = llama()
    target.model.__class__ = ForwardingLlamaModel
    assert check_model(target, batch=2).mask == "2d"
    assert check_model(target, path="static", batch=2).mask == "4d"
    ids, mask = left_padded([9, 5])
    _check_exact(target, ids, mask, cache_implementation="static")


class ForwardingMistralModel(MistralModel):
    """A user's decoder stack of a sliding-window model that wraps transformers' forward."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def test_own_decoder_stack_with_sliding_windows_is_refused_naming_it():
    """An own decoder stack is given the 2-D mask on the dynamic cache, and sliding windows come through 4-D masks:
    refused naming its code (not as an attention implementation that takes no 4-D mask: 'sdpa' does)."""
    target = decoder_only_families()["mistral"](layers=2)
    target.model.__class__ = ForwardingMistralModel
    with pytest.raises(ValueError, match="ForwardingMistralModel.forward is not transformers' code"):
        check_model(target)


class LegacyCacheLlamaModel(LlamaModel):
    """A user's decoder stack written for legacy caches (tuples of (key, value) per layer) inside transformers' LM
    head model: the LM head's forward is transformers', the stack's is not."""

    def forward(self, *args, **kwargs):
        cache = kwargs.get(CACHE)
        if cache is not None:
            assert cache[0][0].shape[-2] >= 0  # (legacy: tuples)
        return super().forward(*args, **kwargs)


def test_own_decoder_stack_breaking_the_cache_contract_is_refused_up_front():
    """The probe forward runs where the decoder stack's code is not transformers', even when the LM head model's is."""
    target = llama()
    target.model.__class__ = LegacyCacheLlamaModel
    ids, mask = left_padded([6, 4])
    with pytest.raises(ValueError, match="LegacyCacheLlamaModel.forward fails when given a transformers Cache"):
        sk.generate(target, ids, attention_mask=mask, draft_model=llama(layers=1, seed=3), max_new_tokens=4,
                    pad_token_id=0)


class LegacyReturnLlama(LlamaForCausalLM):
    """A user's forward that returns its cache as legacy (key, value) tuples per layer."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        cache = out[CACHE]
        out[CACHE] = tuple((layer.keys, layer.values) for layer in cache.layers)
        return out


def test_forward_returning_a_legacy_cache_is_refused_up_front():
    target = llama()
    target.__class__ = LegacyReturnLlama
    ids, mask = left_padded([6, 4])
    with pytest.raises(ValueError, match=f"LegacyReturnLlama.forward returns its cache \\({CACHE}\\) as a tuple"):
        sk.generate(target, ids, attention_mask=mask, draft_model=llama(layers=1, seed=3), max_new_tokens=4,
                    pad_token_id=0)


class StrictLlama(LlamaForCausalLM):
    """A user's forward with explicit keywords and no **kwargs, its cache under this version's keyword."""

    if CACHE == "cache":
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                    return_dict=None, logits_to_keep=0):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, logits_to_keep=logits_to_keep)
    else:
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, return_dict=None, logits_to_keep=0):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, use_cache=use_cache,
                                   logits_to_keep=logits_to_keep)


def test_forward_without_star_kwargs_is_probed_by_its_own_cache_keyword():
    target = llama()
    target.__class__ = StrictLlama
    ids, mask = left_padded([7, 5])
    _check_exact(target, ids, mask)


def _overriding(method: str, base=LlamaForCausalLM):
    """A user's subclass of ``base`` whose ``method`` calls GenerationMixin's (as an override adding a step does)."""
    def override(self, *args, **kwargs):
        return getattr(base, method)(self, *args, **kwargs)

    return type(f"Custom{method.strip('_').title().replace('_', '')}", (base,), {method: override})


@pytest.mark.parametrize("method", ["_update_model_kwargs_for_generation", "_get_logits_processor", "_sample",
                                    "_prepare_generation_config"])
def test_every_step_and_loop_method_of_a_users_class_is_refused(method):
    """model.generate runs a user's override of any of GenerationMixin's per-step or loop methods, the runners run
    none of them: refused as a target, by name."""
    target = llama()
    target.__class__ = _overriding(method)
    with pytest.raises(ValueError, match=f"{type(target).__name__}.{method} \\(in {__name__}, not transformers\\)"):
        check_model(target)


def test_an_override_in_a_users_base_class_is_refused_naming_it():
    """The override sits in a user's base class, not in the model's own class (as in remote code's class trees)."""
    base = _overriding("prepare_inputs_for_generation")
    target = llama()
    target.__class__ = type("Child", (base,), {})
    with pytest.raises(ValueError, match=f"{base.__name__}.prepare_inputs_for_generation \\(in {__name__}"):
        check_model(target)


class ForwardingLlama(LlamaForCausalLM):
    """A user's subclass whose forward wraps transformers' (so the contract probe applies to it)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def test_own_forward_with_offloaded_weights_is_not_probed(tmp_path):
    """Offloaded weights (meta, loaded by accelerate's hooks) are not probed: the probe's ids on the meta device
    failed inside the model ("Cannot copy out of meta tensor"), which refused a model that runs exactly."""
    pytest.importorskip("accelerate")
    llama(layers=3).save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    target = ForwardingLlama.from_pretrained(tmp_path / "m", device_map=device_map,
                                             offload_folder=str(tmp_path / "offload")).eval()
    assert next(target.parameters()).device.type == "meta"
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    got = sk.generate(target, ids, draft_model=llama(layers=1, seed=5), max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)
