"""The runners' eager forwards run without SDPA's cuDNN backend on CUDA (``runners/attention_backends.py``: cuDNN
plans once per new shape, and the dynamic cache's key length is new at every forward). The switch itself is checked
here with a stand-in CUDA device (torch's backend flags are process state, readable on any build); that every eager
forward of each runner runs inside it, with a recording stand-in, on the CPU."""

import contextlib
import types

import pytest
import torch
import torch.nn.functional as F

import speculative_kernels as sk
from speculative_kernels.generation.runners import attention_backends, decoder, seq2seq, static_decoder
from tests.helpers.models import llama, perturbed
from tests.helpers.seq2seq_models import t5

CUDA = types.SimpleNamespace(type="cuda")
FLAGS = ("flash", "mem_efficient", "math", "cudnn")


def flags() -> dict:
    return {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in FLAGS}


@pytest.fixture
def restore_flags():
    before = flags()
    yield
    for name, on in before.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


def test_cuda_forwards_leave_out_cudnn_and_keep_the_rest(restore_flags):
    q, k = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 9, 16)
    mask = torch.zeros(2, 1, 3, 9)
    mask[0, ..., :4] = torch.finfo(torch.float32).min
    before = flags()
    assert before["cudnn"]
    with attention_backends.without_cudnn_attention(CUDA):
        inside = flags()
        out = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    assert inside == {**before, "cudnn": False}
    assert flags() == before  # restored
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, k, attn_mask=mask), rtol=0, atol=0)


def test_a_callers_restrictions_are_kept(restore_flags):
    torch.backends.cuda.enable_flash_sdp(False)
    with attention_backends.without_cudnn_attention(CUDA):
        assert flags() == {"flash": False, "mem_efficient": True, "math": True, "cudnn": False}
    assert flags()["cudnn"] and not flags()["flash"]


@pytest.mark.parametrize("flash", [False, True])
def test_cudnn_without_a_masked_backend_is_left_as_the_caller_set_it(restore_flags, flash):
    """cuDNN alone, or with flash, which takes no mask (every forward of ours passes one): leaving cuDNN out would
    leave no kernel for our forwards."""
    for name in ("flash", "mem_efficient", "math"):
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(name == "flash" and flash)
    with attention_backends.without_cudnn_attention(CUDA):
        assert flags() == {"flash": flash, "mem_efficient": False, "math": False, "cudnn": True}


def test_nothing_changes_while_compiling(restore_flags, monkeypatch):
    before = flags()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with attention_backends.without_cudnn_attention(CUDA):
        assert flags() == before


def test_other_devices_are_untouched(restore_flags):
    before = flags()
    with attention_backends.without_cudnn_attention(torch.device("cpu")):
        assert flags() == before


@pytest.fixture
def recorded(monkeypatch):
    """Replace the switch in every runner module by one that records the devices and marks its extent."""
    state = {"inside": False, "devices": []}

    @contextlib.contextmanager
    def switch(device):
        state["devices"].append(device)
        state["inside"] = True
        try:
            yield
        finally:
            state["inside"] = False

    for module in (decoder, static_decoder, seq2seq):
        monkeypatch.setattr(module, "without_cudnn_attention", switch)
    return state


def inside_flags(models, state) -> list:
    """For each forward of ``models`` (top level) from now on: whether it ran inside the switch."""
    seen = []
    for model in models:
        model.register_forward_pre_hook(sk.per_token_hook(lambda module, args: seen.append(state["inside"])))
    return seen


@pytest.mark.parametrize("cache", [None, "static"])
def test_every_eager_decoder_forward_runs_inside_the_switch(recorded, cache):
    target = llama(layers=2)
    draft = perturbed(target)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7], [0, 0, 1, 8, 6, 2]])
    mask = (ids != 0).long()
    want = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    seen = inside_flags((target, draft), recorded)
    kwargs = {} if cache is None else {"cache_implementation": "static"}
    out = sk.generate(target, ids, attention_mask=mask, draft_model=draft, max_new_tokens=12, do_sample=False,
                      **kwargs)
    assert torch.equal(out, want)
    assert seen and all(seen), seen
    assert recorded["devices"] and all(d == ids.device for d in recorded["devices"])


def test_every_seq2seq_decoder_forward_runs_inside_the_switch(recorded):
    target = t5()
    draft = perturbed(target)
    ids = torch.tensor([[5, 9, 14, 3, 7, 1]])
    want = target.generate(ids, max_new_tokens=10, do_sample=False)
    seen = inside_flags((target.get_decoder(), draft.get_decoder()), recorded)
    out = sk.generate(target, ids, draft_model=draft, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, want)
    assert seen and all(seen), seen
