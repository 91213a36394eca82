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
    # (a torch.compile wrapper of it: refused as one, naming _orig_mod, not as an unaudited 'prefix_tuning' module)
    with pytest.raises(TypeError, match=r"model is a torch.compile wrapper \(OptimizedModule\) of PeftModelForCausalLM"):
        sk.generate(torch.compile(prefix), ids, draft_model=target, max_new_tokens=3)
    activated = _lora(target, task_type="CAUSAL_LM", alora_invocation_tokens=[17])
    with pytest.raises(ValueError, match=r"activated LoRA"):
        sk.generate(activated, ids, draft_model=target, max_new_tokens=3)


def _perturbed_adapter(model, names=None):
    """The adapter's trainable weights moved, so that it acts (several tuners start as the identity)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if (parameter.requires_grad if names is None else names in name):
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model.eval()


def test_tuners_not_audited_as_per_token_are_refused_by_name():
    """Lily averages its router over every token of a forward (a verification forward over gamma + 1 tokens mixed
    its experts otherwise: silently other tokens than the wrapper's generate, also with its layers injected in a
    plain transformers model), X-LoRA's wrapper sets its scalings by hooks of its own forward (skipped: other
    tokens), Shadow threads its own KV cache through past_key_values (a crash inside torch). Tuners not audited as
    per-token are refused by name, wrapped or injected; an audited one (LoRA) still runs."""
    target = llama()
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    draft = llama(layers=1, seed=4)
    if not hasattr(peft, "LilyConfig"):
        pytest.skip(f"peft {peft.__version__} has no Lily tuner")
    torch.manual_seed(7)
    config = dict(target_modules=["q_proj", "v_proj"])
    wrapped = _perturbed_adapter(peft.get_peft_model(copy.deepcopy(target), peft.LilyConfig(task_type="CAUSAL_LM",
                                                                                             **config)))
    # (before: silently other tokens than the wrapper's own generate)
    with pytest.raises(ValueError, match="model is a PEFT PeftModelForCausalLM with the LilyConfig adapter .*router "
                                         "probabilities averaged"):
        sk.generate(wrapped, ids, draft_model=draft, max_new_tokens=12)
    injected = _perturbed_adapter(peft.inject_adapter_in_model(peft.LilyConfig(**config), copy.deepcopy(target)),
                                  "lily")
    with pytest.raises(ValueError, match="target holds a PEFT module .*Lily mixes its experts"):
        sk.SpeculativeDecoder(injected, draft)
    with pytest.raises(ValueError, match="draft_model holds a PEFT module .*Lily"):
        sk.generate(target, ids, draft_model=injected, max_new_tokens=12)
    if hasattr(peft, "ShadowConfig"):
        shadow = peft.get_peft_model(copy.deepcopy(target), peft.ShadowConfig(
            task_type="CAUSAL_LM", shadow_num_hidden_layers=1, shadow_hidden_size=16, shadow_num_attention_heads=4,
            shadow_intermediate_size=32, init_weights=False)).eval()
        with pytest.raises(ValueError, match="Shadow threads a paired shadow KV cache"):
            sk.generate(shadow, ids, draft_model=draft, max_new_tokens=12)
    lora = _lora(target, task_type="CAUSAL_LM")
    assert torch.equal(sk.generate(lora, ids, draft_model=draft, max_new_tokens=12),
                       lora.generate(input_ids=ids, max_new_tokens=12))


def test_an_x_lora_wrapper_is_refused_by_name(tmp_path):
    if not hasattr(peft, "XLoraConfig"):
        pytest.skip(f"peft {peft.__version__} has no X-LoRA")
    target = llama()
    adapters = {}
    for i in range(2):
        torch.manual_seed(10 + i)
        _lora(target, task_type="CAUSAL_LM").save_pretrained(tmp_path / f"a{i}")
        adapters[str(i)] = str(tmp_path / f"a{i}")
    base = copy.deepcopy(target)
    base.config.use_cache = False  # (X-LoRA requires it)
    torch.manual_seed(3)
    xlora = peft.get_peft_model(base, peft.XLoraConfig(task_type="CAUSAL_LM", hidden_size=32, xlora_depth=2,
                                                       adapters=adapters)).eval()
    with pytest.raises(ValueError, match="model is a PEFT PeftModelForCausalLM driven by XLoraModel.*classifier pass"):
        sk.generate(xlora, torch.tensor([[5, 17, 42]]), draft_model=llama(layers=1, seed=4), max_new_tokens=6)


def test_a_generation_config_set_on_the_causal_lm_wrapper_applies_as_in_its_generate():
    """PeftModelForCausalLM.generate hands the wrapper's generation_config to the inner model at every call; one set
    on the wrapper (``peft_model.generation_config = GenerationConfig(...)``) was ignored (the inner model's was
    used: 20 new tokens instead of 6, do_sample and repetition_penalty ignored, silently). Target and draft (HF's
    assisted generation reads the assistant's generation_config off the object it is given)."""
    from transformers import GenerationConfig

    target, draft = llama(), llama(layers=1, seed=4)
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    settings = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    wrapped = _lora(target, task_type="CAUSAL_LM")
    reference = copy.deepcopy(wrapped)
    for model in (wrapped, reference):
        model.generation_config = GenerationConfig(max_new_tokens=6, repetition_penalty=1.8, **settings)
    got = sk.generate(wrapped, ids, draft_model=draft)
    assert got.shape[1] == 11 and torch.equal(got, reference.generate(input_ids=ids))
    sampled = _lora(target, task_type="CAUSAL_LM")
    sampled.generation_config = GenerationConfig(do_sample=True, top_k=2, max_new_tokens=30, **settings)
    runs = {tuple(sk.generate(sampled, ids, draft_model=draft, seed=s)[0].tolist()) for s in range(4)}
    assert len(runs) > 1  # sampled, not greedy
    plain = _lora(target, task_type="CAUSAL_LM")
    draft_wrapper = _lora(draft, modules=("q_proj",), task_type="CAUSAL_LM")
    draft_wrapper.generation_config = GenerationConfig(num_assistant_tokens=2, **settings)
    stats = sk.SpeculationStats()
    sk.generate(plain, ids, draft_model=draft_wrapper, max_new_tokens=8, speculation_stats=stats)
    assert stats.num_speculative_tokens == 2


def test_peft_per_row_adapter_hooks_are_refused_by_name_on_target_and_draft():
    """peft's mixed-batch adapter_names=[...] installs pre-hooks on its layers that give each row of a forward the
    adapter at its index in the batch (``PeftModel.generate(adapter_names=...)``, or its ``_enable_peft_forward_hooks``
    context around a call). The speculative forwards do not hold the caller's rows in order (finished rows leave,
    prefills run apart): as a draft this crashed inside peft ("Length of `adapter_names` should be the same as the
    number of inputs"); as a target it was refused as an unmarked hook, with advice to mark it per-token (which
    would not be exact). Refused by name, target or draft, also marked, in generate and SpeculativeDecoder."""
    target, draft = llama(), llama(layers=1, seed=4)
    wrapped = _lora(target, task_type="CAUSAL_LM")
    wrapped.add_adapter("other", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    wrapped.eval()
    ids = torch.tensor([[0, 0, 5, 17, 42], [9, 33, 21, 64, 8]])
    mask = (ids != 0).long()
    with pytest.raises(ValueError, match=r"unsupported keyword arguments .*\['adapter_names'\]; PEFT's adapter_names "
                                         r"\(one adapter per row\) is not supported.*set_adapter"):
        sk.generate(wrapped, ids, attention_mask=mask, draft_model=draft, adapter_names=["default", "other"])
    decoder = sk.SpeculativeDecoder(wrapped, draft)
    decoder.add_request([5, 6, 7], max_new_tokens=2)  # (checked before the hooks exist)
    with wrapped.base_model._enable_peft_forward_hooks(adapter_names=["default", "other"]):
        hook = next(h for m in wrapped.modules() for h in m._forward_pre_hooks.values())
        sk.per_token_hook(hook)  # (a mark does not make it exact)
        with pytest.raises(ValueError, match=r"model: LlamaForCausalLM .*peft's per-row adapter hook "
                                             r"\(adapter_names=.*on model.layers.0.self_attn.q_proj"):
            sk.generate(wrapped, ids, attention_mask=mask, draft_model=draft, max_new_tokens=6)
        with pytest.raises(ValueError, match=r"draft_model: LlamaForCausalLM .*peft's per-row adapter hook"):
            sk.generate(target, ids, attention_mask=mask, draft_model=wrapped, max_new_tokens=6)
        with pytest.raises(ValueError, match=r"target: LlamaForCausalLM .*peft's per-row adapter hook"):
            decoder.add_request([5, 6, 7], max_new_tokens=2)
        with pytest.raises(ValueError, match=r"draft: LlamaForCausalLM .*peft's per-row adapter hook"):
            sk.SpeculativeDecoder(target, wrapped).add_request([5, 6, 7], max_new_tokens=2)
    expected = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(sk.generate(wrapped, ids, attention_mask=mask, draft_model=draft, max_new_tokens=6), expected)


def test_prompt_learning_inside_disable_adapter_runs_as_the_wrapper_generates():
    """Inside ``disable_adapter()`` a prompt-learning wrapper's forward is its base model's (peft swaps it): its
    generate gives the base model's tokens. It was refused as prompt learning; it is driven (target, draft,
    SpeculativeDecoder), and refused again once the context is left. A generation_config set on such a wrapper is
    not the inner model's in peft's generate (it hands it to the inner model's ``.model``): still ignored here."""
    from transformers import GenerationConfig

    target, draft = llama(), llama(layers=1, seed=4)
    ids = torch.tensor([[0, 0, 5, 17, 42], [9, 33, 21, 64, 8]])
    mask = (ids != 0).long()
    for config in (peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
                   peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)):
        wrapped = _perturbed_adapter(peft.get_peft_model(copy.deepcopy(target), config))
        wrapped.generation_config = GenerationConfig(max_new_tokens=3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        with wrapped.disable_adapter():
            expected = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
            assert torch.equal(expected, target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
            assert torch.equal(sk.generate(wrapped, ids, attention_mask=mask, draft_model=draft, max_new_tokens=8),
                               expected)
            assert torch.equal(sk.generate(target, ids, attention_mask=mask, draft_model=wrapped, max_new_tokens=8),
                               expected)
            default_length = wrapped.generate(input_ids=ids, attention_mask=mask, do_sample=False)
            assert default_length.shape[1] == 25  # (20 new: the wrapper's max_new_tokens=3 is not applied)
            assert torch.equal(sk.generate(wrapped, ids, attention_mask=mask, draft_model=draft), default_length)
        assert not torch.equal(wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                                do_sample=False), expected)  # (the adapter acts)
        with pytest.raises(ValueError, match=r"prompt learning .*; it has no weights to merge: use model.generate$"):
            sk.generate(wrapped, ids, attention_mask=mask, draft_model=draft, max_new_tokens=8)


def test_a_decoder_reads_its_peft_wrappers_again_at_each_request():
    """A SpeculativeDecoder read its PEFT wrappers once, when made: a generation_config set on the wrapper afterwards
    (applied by the wrapper's generate) was ignored (20 new tokens instead of 3, silently), and a prompt-learning
    wrapper whose decoder was made inside disable_adapter() ran the base model after the context was left, where
    peft applies the prompt. Each add_request (and start) reads the wrappers again."""
    from transformers import GenerationConfig

    target, draft = llama(), llama(layers=1, seed=4)
    prompt = [5, 17, 42, 70, 7]
    wrapped = _lora(target, task_type="CAUSAL_LM")
    decoder = sk.SpeculativeDecoder(wrapped, draft, num_speculative_tokens=3)
    wrapped.generation_config = GenerationConfig(max_new_tokens=3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    request = decoder.add_request(prompt)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(request).token_ids == wrapped.generate(input_ids=torch.tensor([prompt]))[0, 5:].tolist()
    assert len(decoder.result(request).token_ids) == 3
    prefix = _perturbed_adapter(peft.get_peft_model(copy.deepcopy(target), peft.PrefixTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=3)))
    with prefix.disable_adapter():
        decoder = sk.SpeculativeDecoder(prefix, draft)
        decoder.add_request(prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match="target is a PEFT .*PrefixTuningConfig.*prompt learning"):
        decoder.add_request(prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match="target is a PEFT .*prompt learning"):
        decoder.start(torch.tensor([prompt]), max_new_tokens=4)


def test_randomness_of_peft_layers_is_refused_by_name():
    """Some peft layers draw random numbers in their forward where no torch dropout module shows it: LoHa's and
    LoKr's rank_dropout/module_dropout (floats per adapter) and PVeRA's sampled projection in training mode, PVeRA
    with sample_at_inference=True in eval mode too. model.generate's output is then random (its draws follow its
    one-token forwards); the target ran, giving other tokens, silently. Refused by name as training-mode dropout
    is; the same adapters without their randomness run exactly."""
    target, draft = llama(), llama(layers=1, seed=4)
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    modules = dict(target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    training = {"rank_dropout=0.5": peft.LoHaConfig(r=4, rank_dropout=0.5, **modules),
                "module_dropout=0.3": peft.LoKrConfig(r=4, module_dropout=0.3, **modules),
                "PVeRA's sampled projection": peft.PveraConfig(r=4, **modules)}
    for what, config in training.items():
        wrapped = _perturbed_adapter(peft.get_peft_model(copy.deepcopy(target), config)).train()
        with pytest.raises(ValueError, match=rf"is in training mode with a PEFT layer's randomness active \("
                                             rf"model.layers.0.self_attn.q_proj: {what}\).*model.eval\(\)"):
            sk.generate(wrapped, ids, draft_model=draft, max_new_tokens=8)
        wrapped.eval()
        assert torch.equal(sk.generate(wrapped, ids, draft_model=draft, max_new_tokens=8),
                           wrapped.generate(input_ids=ids, max_new_tokens=8, do_sample=False))
    sampling = _perturbed_adapter(peft.get_peft_model(copy.deepcopy(target), peft.PveraConfig(
        r=4, sample_at_inference=True, **modules)))
    with pytest.raises(ValueError, match=r"runs with a PEFT layer's randomness active .*sample_at_inference=True"):
        sk.generate(sampling, ids, draft_model=draft, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"sample_at_inference=True"):
        sk.SpeculativeDecoder(sampling, draft).add_request(ids[0].tolist(), max_new_tokens=8)
    with sampling.disable_adapter():  # (no adapter, no draws)
        assert torch.equal(sk.generate(sampling, ids, draft_model=draft, max_new_tokens=8),
                           target.generate(ids, max_new_tokens=8, do_sample=False))
    assert torch.equal(sk.generate(target, ids, draft_model=sampling, max_new_tokens=8),  # (a draft's may be random)
                       target.generate(ids, max_new_tokens=8, do_sample=False))
    with pytest.raises(ValueError, match=r"seed=3 cannot make this run reproducible: draft_model \(LlamaForCausalLM\) "
                                         r"runs with .*sample_at_inference=True"):
        sk.generate(target, ids, draft_model=sampling, max_new_tokens=8, do_sample=True, seed=3)


def test_merged_lycoris_adapters_in_training_mode_run_exactly():
    """A merged LoHa/LoKr layer's forward is its base layer alone (the merged weights): its rank_dropout and
    module_dropout draw nothing, so a merged wrapper in training mode generates deterministically and is driven
    exactly (it was refused as random, falsely)."""
    target, draft = llama(), llama(layers=1, seed=4)
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    modules = dict(target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    for config in (peft.LoHaConfig(r=4, rank_dropout=0.5, module_dropout=0.3, **modules),
                   peft.LoKrConfig(r=4, module_dropout=0.3, **modules)):
        wrapped = _perturbed_adapter(peft.get_peft_model(copy.deepcopy(target), config))
        wrapped.merge_adapter()  # (in eval mode: the merge itself draws no rank dropout)
        wrapped.train()
        expected = wrapped.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(wrapped.generate(input_ids=ids, max_new_tokens=8, do_sample=False), expected)
        assert torch.equal(sk.generate(wrapped, ids, draft_model=draft, max_new_tokens=8), expected)


def test_lora_dropout_of_a_merged_or_disabled_adapter_in_training_mode_is_not_refused():
    """A LoRA layer whose adapter is merged or disabled runs its base layer alone: its lora_dropout module is never
    called, so the wrapper in training mode generates deterministically and is driven exactly (it was refused as
    dropout active, falsely); with the adapter active the dropout acts and stays refused."""
    target, draft = llama(), llama(layers=1, seed=4)
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    wrapped = _lora(target, modules=("q_proj",), lora_dropout=0.1).train()
    with pytest.raises(ValueError, match=r"dropout active \(model.layers.0.self_attn.q_proj.lora_dropout.default"):
        sk.generate(wrapped, ids, draft_model=draft, max_new_tokens=8)
    with wrapped.disable_adapter():
        assert torch.equal(sk.generate(wrapped, ids, draft_model=draft, max_new_tokens=8),
                           target.generate(ids, max_new_tokens=8, do_sample=False))
    wrapped.eval().merge_adapter()
    wrapped.train()
    expected = wrapped.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(wrapped.generate(input_ids=ids, max_new_tokens=8, do_sample=False), expected)
    assert torch.equal(sk.generate(wrapped, ids, draft_model=draft, max_new_tokens=8), expected)
