"""Quantized targets (``capabilities._dynamic_quantization_reason``, ``_inference_mode_reason``,
``_activation_scales_reason``: fake-quantize, optimum-quanto and torchao activation quantization): the cases
test_architectures.py leaves open, each failing on the old code or on a mutant of those checks that it let through
(mutation round 6). Weights shaped as torchao's / optimum-quanto's stand in where the check reads only their class
and attributes (CI installs neither library)."""

import pytest
import torch
from helpers.models import llama, perturbed

import speculative_kernels as sk
from speculative_kernels.generation import request as request_module
from speculative_kernels.generation.capabilities import check_model

KWARGS = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)


def _ids():
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    return ids, mask


def _no_loop(*args, **kwargs):
    raise AssertionError("a runner or loop (and its caches) was built for a model that should be refused")


def _refused(model, match, monkeypatch):
    """generate raises ValueError naming the model before any runner or cache exists; check_model too."""
    ids, mask = _ids()
    with monkeypatch.context() as patch, pytest.raises(ValueError, match=f"{type(model).__name__}.*{match}"):
        patch.setattr(request_module, "make_runner", _no_loop)
        patch.setattr(request_module, "SpeculativeLoop", _no_loop)
        sk.generate(model, ids, attention_mask=mask, draft_model=llama(layers=1, seed=3), num_speculative_tokens=3,
                    **KWARGS)
    with pytest.raises(ValueError, match=match):
        check_model(model, batch=2)


def _exact(model):
    ids, mask = _ids()
    expected = model.generate(ids, attention_mask=mask, **KWARGS)
    got = sk.generate(model, ids, attention_mask=mask, draft_model=perturbed(model, 0.3), num_speculative_tokens=3,
                      **KWARGS)
    assert torch.equal(got, expected)


def _qat(model):
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.qconfig = get_default_qat_qconfig("fbgemm")
    prepare_qat(model, inplace=True)
    return model.eval()


def test_fake_quantize_refusal_names_three_modules_and_counts_the_rest(monkeypatch):
    """The refusal names the first three fake-quantize modules and counts the others."""
    model = _qat(llama())
    count = sum(1 for module in model.modules() if isinstance(module, torch.ao.quantization.FakeQuantizeBase))
    _refused(model, r"fake-quantize modules whose observers are on \([^,()]+, [^,()]+, [^,()]+, "
                    rf"and {count - 3} more: quantization-aware training\)", monkeypatch)


def _quanto_module(proj, activation_qtype):
    """``proj`` shaped as an optimum-quanto QLinear (QModuleMixin) with ``activation_qtype``."""
    mixin = type("QModuleMixin", (), {"__module__": "optimum.quanto.nn.qmodule"})
    proj.__class__ = type("QLinear", (type(proj), mixin), {"__module__": "optimum.quanto.nn.qlinear"})
    proj.activation_qtype = activation_qtype


def test_quanto_weight_only_modules_run_exactly():
    """optimum-quanto modules without activation quantization (quantize(model, weights=qint8): activation_qtype
    None) are exact; only those quantizing activations are refused."""
    model = llama()
    for layer in model.model.layers:
        _quanto_module(layer.self_attn.q_proj, None)
    _exact(model)


def _torchao_weight(weight, class_name, **attributes):
    subclass = type(class_name, (torch.Tensor,), {"__module__": "torchao.quantization.quantize_.workflows"})
    parameter = torch.nn.Parameter(weight.detach().as_subclass(subclass), requires_grad=False)
    for name, value in attributes.items():
        setattr(parameter, name, value)
    return parameter


def test_torchaos_older_activation_wrapper_is_refused(monkeypatch):
    """torchao's older activation quantization wraps the weight with an input_quant_func
    (LinearActivationQuantizedTensor, torchao before 0.15's int8_dynamic_activation_*): refused by name."""
    model = llama()
    proj = model.model.layers[0].mlp.up_proj
    proj.weight = _torchao_weight(proj.weight, "LinearActivationQuantizedTensor", input_quant_func=lambda x: x)
    _refused(model, r"torchao tensors that quantize activations \(model.layers.0.mlp.up_proj.weight \(activation "
                    r"quantization of LinearActivationQuantizedTensor\)\)", monkeypatch)


@pytest.mark.parametrize("weight", ["Int4OpaqueTensor", "IntxOpaqueTensor"])
def test_torchaos_packed_cpu_activation_quantization_is_refused(weight, monkeypatch):
    """torchao's packed CPU layouts quantize activations without the attributes the check read:
    Int8DynamicActivationInt4WeightConfig (prototype, DA8W4 on x86) gives Int4OpaqueTensor with ``act_mapping_type``
    ("asymmetric" / "symmetric": int8 activations; None is its weight-only A16W4), and
    Int8DynamicActivationIntxWeightConfig(intx_packing_format="opaque_...") gives IntxOpaqueTensor, which torchao
    packs only from int8_asym_per_token weights (its linear is _linear_8bit_act_*bit_weight). Both were accepted
    as weight-only: per-token activation quantization, which gave other greedy tokens (measured with the unpacked
    IntxUnpackedToInt8Tensor). (Weights shaped as theirs: their kernels are not built on every machine.)"""
    model = llama()
    proj = model.model.layers[1].self_attn.o_proj
    original = proj.weight
    if weight == "Int4OpaqueTensor":
        proj.weight = _torchao_weight(original, weight, act_mapping_type="asymmetric")
        _refused(model, r"torchao tensors that quantize activations \(model.layers.1.self_attn.o_proj.weight \(int8 "
                        r"asymmetric activations of Int4OpaqueTensor\)\)", monkeypatch)
        proj.weight = _torchao_weight(original, weight, act_mapping_type=None)  # A16W4: weight-only
        check_model(model, batch=2)
    else:
        proj.weight = _torchao_weight(original, weight, bit_width=4)
        _refused(model, r"torchao tensors that quantize activations \(model.layers.1.self_attn.o_proj.weight "
                        r"\(int8_asym_per_token of IntxOpaqueTensor\)\)", monkeypatch)
