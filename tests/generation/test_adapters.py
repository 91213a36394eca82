"""Models wrapped by PEFT (LoRA and the other tuners that inject layers in place) are driven through the
transformers model inside, exactly as the wrapper's generate; adapters that change the forward itself are refused by
name (``generation/adapters.py``)."""

import copy

import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama
from helpers.seq2seq_models import source_batch, t5

peft = pytest.importorskip("peft")


def _lora(model, modules=("q_proj", "v_proj"), **kwargs):
    config = peft.LoraConfig(r=4, target_modules=list(modules), init_lora_weights=False, **kwargs)
    return peft.get_peft_model(copy.deepcopy(model), config).eval()


def test_lora_target_and_draft_as_the_wrapper_generates():
    target = llama()
    wrapped = _lora(target, task_type="CAUSAL_LM")
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    expected = wrapped.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    assert not torch.equal(expected, target.generate(ids, max_new_tokens=12, do_sample=False))  # the adapter acts
    draft = llama(layers=1, seed=4)
    for model in (wrapped, wrapped.base_model):  # the PeftModel, and its LoraModel
        assert torch.equal(sk.generate(model, ids, draft_model=draft, max_new_tokens=12, do_sample=False), expected)
    assert torch.equal(sk.generate(wrapped, ids, draft_model=_lora(draft, modules=("q_proj",)), max_new_tokens=12,
                                   do_sample=False), expected)
    with wrapped.disable_adapter():  # acts on the injected layers: the base model's output
        assert torch.equal(sk.generate(wrapped, ids, prompt_lookup_num_tokens=3, max_new_tokens=12, do_sample=False),
                           target.generate(ids, max_new_tokens=12, do_sample=False))
    decoder = sk.SpeculativeDecoder(wrapped, draft, num_speculative_tokens=3)
    request = decoder.add_request(ids[0].tolist(), max_new_tokens=12)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(request).token_ids == expected[0, 5:].tolist()


def test_lora_seq2seq_as_the_wrapper_generates():
    target = t5()
    wrapped = _lora(target, modules=("q", "v"), task_type="SEQ_2_SEQ_LM")
    ids, mask = source_batch([6, 4])
    expected = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    got = sk.generate(wrapped, ids, attention_mask=mask, draft_model=target, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


def test_adapters_that_change_the_forward_are_refused():
    target = llama()
    ids = torch.tensor([[5, 17, 42]])
    prefix = peft.get_peft_model(copy.deepcopy(target),
                                 peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    with pytest.raises(ValueError, match=r"model is a PEFT PeftModelForCausalLM with the PrefixTuningConfig adapter "
                                         r"'default'.*prompt learning"):
        sk.generate(prefix, ids, draft_model=target, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"draft_model is a PEFT .*prompt learning"):
        sk.generate(target, ids, draft_model=prefix, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"target is a PEFT .*prompt learning"):
        sk.SpeculativeDecoder(prefix, target)
    activated = _lora(target, task_type="CAUSAL_LM", alora_invocation_tokens=[17])
    with pytest.raises(ValueError, match=r"activated LoRA"):
        sk.generate(activated, ids, draft_model=target, max_new_tokens=3)
