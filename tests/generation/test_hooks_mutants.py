"""Forward hooks on the target (``hooks.py``: ``per_token_hook``, ``unmarked_hooks``, the known per-token hooks):
the cases test_hooks.py leaves open, each failing on the old code or on a mutant of those checks that it let through
(mutation round 6)."""

import pytest
import torch
from helpers.models import llama, perturbed

import speculative_kernels as sk

KWARGS = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
IDS = torch.tensor([[5, 17, 42, 70, 7]])


def test_neftune_in_training_mode_is_refused():
    """NEFTune's hook (activate_neftune; the Trainer's neftune_noise_alpha) is known per-token, but in training mode
    it adds uniform noise to the embeddings at every forward: a target in training mode without dropout (Llama's
    default) and NEFTune active was accepted, every forward random (other tokens than model.generate), silently.
    Refused naming it; in eval mode (the hook returns the embeddings unchanged) it is exact."""
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    target = llama()
    handle = activate_neftune(target, 5.0)
    target.train()
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is in training mode with training-mode randomness active "
                                         r"\(model.embed_tokens: NEFTune noise, neftune_noise_alpha=5.0\).*"
                                         r"model.eval\(\)"):
        sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    target.eval()
    expected = target.generate(IDS, **KWARGS)
    assert torch.equal(sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS),
                       expected)
    deactivate_neftune(target, handle)
    target.train()  # without NEFTune (and no dropout) training mode is deterministic: accepted
    assert torch.equal(sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS),
                       expected)


def test_weight_norm_is_known_per_token():
    """torch.nn.utils.weight_norm (the older API: a WeightNorm forward pre-hook recomputing the weight from its
    parts) acts on every position alike: a target with it runs, exactly as model.generate."""
    target = llama()
    for layer in target.model.layers:
        torch.nn.utils.weight_norm(layer.self_attn.o_proj)
        torch.nn.utils.weight_norm(layer.mlp.down_proj)
    expected = target.generate(IDS, **KWARGS)
    assert torch.equal(sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS),
                       expected)


def _bias_last(module, args, logits, token):
    logits[:, -1, token] += 100.0


class LastPositionBias:
    """A hook object (a callable instance, no __qualname__ of its own)."""

    def __call__(self, module, args, logits):
        logits[:, -1, 11] += 100.0


@pytest.mark.parametrize("kind", ["partial", "callable object"])
def test_a_partial_or_a_callable_object_is_named_by_its_function(kind):
    """A hook registered as functools.partial(function, ...) or as a callable object is refused naming the
    function (or the object's class), not "partial" or a placeholder."""
    import functools

    target = llama()
    hook, name = ((functools.partial(_bias_last, token=11), "_bias_last") if kind == "partial"
                  else (LastPositionBias(), "LastPositionBias"))
    handle = target.lm_head.register_forward_hook(hook)
    try:
        with pytest.raises(ValueError, match=rf"forward hooks .*\(lm_head \(forward hook {name}\)\)"):
            sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    finally:
        handle.remove()


def _steer_all(module, args, output, vector):
    """Steering every position alike (a per-token hook)."""
    return output + vector if not isinstance(output, tuple) else (output[0] + vector, *output[1:])


@pytest.mark.parametrize("marked", ["the partial", "the function"])
def test_a_marked_partial_runs_exactly(marked):
    """per_token_hook(functools.partial(hook, ...)) marks the partial; functools.partial(per_token_hook(hook), ...)
    (a decorated hook bound per layer) carries the mark on its function: either runs, exactly as model.generate."""
    import functools

    target = llama(layers=4)
    vector = torch.randn(target.config.hidden_size, generator=torch.Generator().manual_seed(9))
    plain = target.generate(IDS, **KWARGS)
    if marked == "the partial":
        hooks = [sk.per_token_hook(functools.partial(_steer_all, vector=vector * (i + 1))) for i in range(2)]
    else:
        steer = sk.per_token_hook(lambda module, args, output, vector: _steer_all(module, args, output, vector))
        hooks = [functools.partial(steer, vector=vector * (i + 1)) for i in range(2)]
    handles = [target.model.layers[i].register_forward_hook(hook) for i, hook in enumerate(hooks)]
    try:
        expected = target.generate(IDS, **KWARGS)
        got = sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    finally:
        for handle in handles:
            handle.remove()
    assert not torch.equal(expected, plain)  # the steering matters
    assert torch.equal(got, expected)


def _steer_last_input(vector):
    def hook(*args):  # a forward pre-hook: (module, args), global or per module
        inputs = args[1]
        if inputs and torch.is_tensor(inputs[0]) and inputs[0].is_floating_point():
            inputs[0][:, -1] += vector
    return hook


@pytest.mark.parametrize("where", ["module", "global"])
def test_a_forward_pre_hook_that_steers_the_last_position_is_refused(where):
    """A forward pre-hook changing the last position's input (a decoder layer's, or a global pre-hook on it) acts
    on another token in a verification forward than in model.generate's one-token steps: refused by name like a
    forward hook."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    target = llama(layers=4)
    layer = target.model.layers[1]
    steer = _steer_last_input(torch.randn(target.config.hidden_size, generator=torch.Generator().manual_seed(9)) * 2)
    plain = target.generate(IDS, **KWARGS)
    handle = layer.register_forward_pre_hook(steer) if where == "module" else register_module_forward_pre_hook(
        lambda module, args: steer(module, args) if module is layer else None)
    try:
        assert not torch.equal(target.generate(IDS, **KWARGS), plain)  # it matters in HF
        name = r"model.layers.1 \(forward pre-hook .*hook\)" if where == "module" else \
            r"every module \(global forward pre-hook .*<lambda>\)"
        with pytest.raises(ValueError, match=rf"forward hooks .*{name}.*per_token_hook"):
            sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    finally:
        handle.remove()


def test_a_hook_on_the_model_itself_and_many_hooks_are_named():
    """A hook on the top-level model (a logit bias on out.logits[:, -1]) is named "model"; with more than four
    unmarked hooks the first four are named and the rest counted."""
    target = llama()

    def bias_last(module, args, out):
        out.logits[:, -1, 11] += 100.0
    handles = [target.register_forward_hook(bias_last)]
    try:
        with pytest.raises(ValueError, match=r"forward hooks .*\(model \(forward hook .*bias_last\)\)"):
            sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
        handles += [target.model.layers[i % 2].register_forward_hook(lambda module, args, out: None)
                    for i in range(5)]
        lambda_hook = r"model.layers.0 \(forward hook [^)]*<lambda>\)"
        with pytest.raises(ValueError, match=rf"\(model \(forward hook [^)]*bias_last\), {lambda_hook}, {lambda_hook}, "
                                             rf"{lambda_hook}, and 2 more\)"):
            sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("family,cache", [("bart", None), ("t5", "static")])
def test_our_own_position_hooks_do_not_refuse_another_threads_call(family, cache):
    """The seq2seq runners' position hooks sit on the model's shared submodules during each forward. Another
    thread's speculative_kernels.generate on the same model meanwhile (a threaded server) checks the target's hooks:
    ours are not the caller's and are not refused; both calls are exact."""
    from helpers.seq2seq_models import SEQ2SEQ_FAMILIES, seq2seq_drafts_for, source_batch
    from helpers.threads import run_while_held

    target = SEQ2SEQ_FAMILIES[family]()
    draft = seq2seq_drafts_for(family, target)["perturbed"]
    pad = target.config.pad_token_id
    (ids_a, mask_a), (ids_b, mask_b) = source_batch([6, 8], seed=1, pad=pad), source_batch([9, 4], seed=2, pad=pad)
    kwargs = dict(do_sample=False, max_new_tokens=10, eos_token_id=None)
    expected_a = target.generate(ids_a, attention_mask=mask_a, **kwargs)
    expected_b = target.generate(ids_b, attention_mask=mask_b, **kwargs)
    run_a = lambda: sk.generate(target, ids_a, attention_mask=mask_a, draft_model=draft, num_speculative_tokens=3,
                                cache_implementation=cache, **kwargs)
    run_b = lambda: sk.generate(target, ids_b, attention_mask=mask_b, draft_model=draft, num_speculative_tokens=3,
                                **kwargs)
    decoder = target.get_decoder()
    # (held inside A's first decoder forward, our position hooks registered)
    out = run_while_held(decoder.block[0] if family == "t5" else decoder.layers[0], run_a, run_b, catch=ValueError)
    assert not isinstance(out["b"], ValueError), out["b"]
    assert torch.equal(out["b"], expected_b)
    assert torch.equal(out["a"], expected_a)
