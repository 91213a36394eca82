"""Forward hooks on the target. Verification runs several tokens per forward where model.generate runs one, so a
hook that acts on the last position, counts its calls or reads the last position_ids acted on other tokens: other
output than model.generate, silently (the hooks below, each measured on the old code, dynamic and static, batch 1
and a left-padded batch, a draft model and early exit). A target's hooks are now refused by name unless marked
per-token (``sk.per_token_hook``); hooks acting on every position alike are exact when marked; a draft's hooks only
change acceptance."""

import pytest
import torch
from helpers.models import llama, perturbed

import speculative_kernels as sk

KWARGS = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)


def _steer(model):
    return torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(9)) * 2


def _hidden(output):
    """A decoder layer's hidden states [B, T, H] (a tensor, or the first of a tuple in older transformers)."""
    return output[0] if isinstance(output, tuple) else output


def _steer_last(model):
    steer = _steer(model)

    def hook(module, args, output):
        _hidden(output)[:, -1] += steer
    return model.model.layers[0], hook, {}


def _logit_bias_last(model):
    def hook(module, args, logits):
        logits[:, -1, 11] += 100.0
    return model.lm_head, hook, {}


def _fourth_call(model):
    calls = []

    def hook(module, args, logits):
        calls.append(1)
        return logits + 100.0 * torch.nn.functional.one_hot(torch.tensor(13), logits.shape[-1]) \
            if len(calls) == 4 else None
    return model.lm_head, hook, {}


def _last_position(model):
    def hook(module, args, kwargs, output):
        if kwargs["position_ids"][0, -1].item() == 10:
            _hidden(output)[:, -1] += 50.0
    return model.model.layers[0], hook, {"with_kwargs": True}


SILENT = {"steering the last position": _steer_last, "a logit bias on logits[:, -1]": _logit_bias_last,
          "a bias on the 4th call": _fourth_call, "the last position_ids": _last_position}


def _ids(batch):
    ids = torch.randint(3, 97, (batch, 7), generator=torch.Generator().manual_seed(3))
    if batch == 1:
        return ids, {}
    ids[1, :3] = 0
    return ids, {"attention_mask": (ids != 0).long()}


def _drafting(target, early_exit):
    return {"assistant_early_exit": 1} if early_exit else {"draft_model": perturbed(target)}


@pytest.mark.parametrize("early_exit", [False, True])
@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", list(SILENT))
def test_a_hook_that_singles_out_the_last_position_or_a_call_is_refused_by_name(kind, batch, cache, early_exit):
    target = llama(layers=4)
    ids, mask = _ids(batch)
    drafting = _drafting(target, early_exit)
    plain = _plain(target, ids, mask, cache)
    module, hook, options = SILENT[kind](target)
    handle = module.register_forward_hook(hook, **options)
    try:
        assert not torch.equal(target.generate(ids, **mask, **cache, **KWARGS), plain)  # it matters in HF
        with pytest.raises(ValueError, match=rf"model: LlamaForCausalLM cannot .* forward hooks .*"
                                             rf"\({'lm_head' if module is target.lm_head else 'model.layers.0'} "
                                             rf"\(forward hook .*hook\)\).*per_token_hook"):
            sk.generate(target, ids, num_speculative_tokens=3, **drafting, **mask, **cache, **KWARGS)
    finally:
        handle.remove()


def _plain(target, ids, mask, cache):
    return target.generate(ids, **mask, **cache, **KWARGS)


def test_a_global_hook_that_steers_the_last_position_is_refused():
    from torch.nn.modules.module import register_module_forward_hook

    target = llama(layers=4)
    ids, mask = _ids(2)
    layer, hook, _ = _steer_last(target)
    handle = register_module_forward_hook(lambda module, args, output: hook(module, args, output)
                                          if module is layer else None)
    try:
        with pytest.raises(ValueError, match=r"every module \(global forward hook .*<lambda>\)"):
            sk.generate(target, ids, draft_model=perturbed(target), num_speculative_tokens=3, **mask, **KWARGS)
    finally:
        handle.remove()


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}])
def test_marked_per_token_hooks_run_exactly(cache):
    """Steering every position, a pre-hook zeroing features (ablation) and recording: marked, each is exact."""
    target = llama(layers=4)
    ids, mask = _ids(2)
    steer = _steer(target)
    recorded = []
    plain = _plain(target, ids, mask, cache)

    def ablate(module, args):
        hidden = args[0].clone()
        hidden[..., :8] = 0
        return (hidden, *args[1:])
    handles = [target.model.layers[0].register_forward_hook(sk.per_token_hook(
                   lambda module, args, output: _hidden(output) + steer if not isinstance(output, tuple)
                   else (output[0] + steer, *output[1:]))),
               target.model.layers[1].mlp.register_forward_pre_hook(sk.per_token_hook(ablate)),
               target.lm_head.register_forward_hook(sk.per_token_hook(lambda m, a, out: recorded.append(out.shape)))]
    try:
        expected = target.generate(ids, **mask, **cache, **KWARGS)
        for drafting in (_drafting(target, False), _drafting(target, True)):
            got = sk.generate(target, ids, num_speculative_tokens=3, **drafting, **mask, **cache, **KWARGS)
            assert torch.equal(got, expected)
    finally:
        for handle in handles:
            handle.remove()
    assert not torch.equal(expected, plain) and recorded


def test_a_drafts_hooks_are_not_refused_and_change_only_acceptance():
    target = llama(layers=4)
    draft = perturbed(target)
    ids, mask = _ids(2)
    handles = [register(draft) for register in
               (lambda d: d.lm_head.register_forward_hook(_logit_bias_last(d)[1]),
                lambda d: d.model.layers[0].register_forward_hook(_steer_last(d)[1]))]
    try:
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **mask, **KWARGS)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(got, target.generate(ids, **mask, **KWARGS))


def test_hooks_libraries_register_are_known_per_token():
    """transformers' output recorders (on every decoder layer once hidden states were asked for) and its
    enable_input_require_grads hook (a PEFT fine-tune's) act on every position: not refused."""
    target = llama()
    target(torch.tensor([[1, 5, 9]]), output_hidden_states=True)
    target.enable_input_require_grads()
    assert any(layer._forward_hooks for layer in target.model.layers)
    assert target.model.embed_tokens._forward_hooks
    ids, mask = _ids(1)
    got = sk.generate(target, ids, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    assert torch.equal(got, target.generate(ids, **KWARGS))


def test_generating_under_torchs_flop_counter_runs():
    """FlopCounterMode (torch's module tracker) registers global hooks that only record which module runs."""
    from torch.utils.flop_counter import FlopCounterMode

    target = llama()
    ids, _ = _ids(1)
    with FlopCounterMode(display=False) as counter:
        got = sk.generate(target, ids, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    assert counter.get_total_flops() > 0
    assert torch.equal(got, target.generate(ids, **KWARGS))


def test_per_token_hook_marks_a_bound_method():
    class Recorder:
        def __init__(self):
            self.shapes = []

        def record(self, module, args, output):
            self.shapes.append(output.shape)

    recorder = Recorder()
    target = llama()
    handle = target.lm_head.register_forward_hook(sk.per_token_hook(recorder.record))
    try:
        ids, _ = _ids(1)
        got = sk.generate(target, ids, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    finally:
        handle.remove()
    assert torch.equal(got, target.generate(ids, **KWARGS)) and recorder.shapes


def test_a_hook_registered_after_the_first_request_is_refused_by_the_next():
    """SpeculativeDecoder checks the models once, at its first add_request: a hook registered after it ran."""
    target = llama()
    decoder = sk.SpeculativeDecoder(target, perturbed(target), num_speculative_tokens=3, max_batch_size=2)
    decoder.add_request([5, 6, 7], max_new_tokens=4, do_sample=False)
    handle = target.lm_head.register_forward_hook(_logit_bias_last(target)[1])
    try:
        with pytest.raises(ValueError, match=r"target: LlamaForCausalLM cannot .*lm_head \(forward hook"):
            decoder.add_request([5, 6, 8], max_new_tokens=4, do_sample=False)
    finally:
        handle.remove()
    decoder.add_request([5, 6, 8], max_new_tokens=4, do_sample=False)
