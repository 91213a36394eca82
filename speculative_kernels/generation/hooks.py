"""Forward hooks on the target. model.generate runs one token per forward after the prefill; verification runs
several (and a prefill of the prompt), so a hook that treats the forward's last position, its call count or the
last ``position_ids`` specially acts on other tokens than in model.generate (measured: a logit bias on
``logits[:, -1]``, steering ``out[0][:, -1] += v``, a bias on the Nth call gave other tokens, silently). A hook that
acts on every position alike (steering all positions, an ablation, recording) is exact, but which kind a hook is
cannot be read from it: the target's hooks are refused by name unless marked with ``per_token_hook``. Hooks on a
draft model change only which tokens are accepted (exact) and are not checked."""

import functools

import torch

_MARK = "_speculative_kernels_per_token"

# Hooks that libraries register on the models they build, each acting on every position alike: transformers'
# output recorders (installed on every decoder layer; they record only while output_hidden_states/attentions is
# requested) and its input-embedding requires_grad hook (PEFT's alike), torch's weight_norm pre-hook (recomputes
# the weight from its parts) and the older spectral_norm's, NEFTune's embedding noise (only in training mode,
# which check_deterministic refuses by name: ``neftune_alpha``), torch's module tracker.
_KNOWN_PER_TOKEN = {
    ("transformers.utils.output_capturing", "install_output_capuring_hook.<locals>.output_capturing_hook"),
    ("transformers.modeling_utils", "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads"),
    ("peft.mixed_model", "_prepare_model_for_gradient_checkpointing.<locals>.make_inputs_require_grad"),
    ("transformers.integrations.neftune", "neftune_post_forward_hook"),
    ("torch.nn.utils.weight_norm", "WeightNorm"),
    # the older spectral_norm's pre-hook: recomputes the weight (its power iteration only in training mode, which
    # check_deterministic refuses by name)
    ("torch.nn.utils.spectral_norm", "SpectralNorm"),
    # torch's module stack tracker (FlopCounterMode, memory trackers): global hooks that only record which module runs
    ("torch.utils.module_tracker", "ModuleTracker._fw_pre_hook"),
    ("torch.utils.module_tracker", "ModuleTracker._fw_post_hook"),
}

# Hooks that route each row of a forward by its index in the batch: peft's mixed-batch pre-hooks (LoRA, GLoRA,
# RoAd), installed on its layers for the length of PeftModel.generate(adapter_names=[...]) (one adapter per row) or
# of aLoRA's generate (each row's activation offset). Refused on a draft too, even marked: speculative decoding's
# forwards do not hold the caller's rows in the caller's order (finished rows leave the batch, rows are prefilled
# apart), so a row would run another row's adapter, or peft fails on the count.
_PER_ROW = {
    "_adapter_names_pre_forward_hook": "peft's per-row adapter hook (adapter_names=[...], one adapter per row)",
    "_alora_offsets_pre_forward_hook": "peft's activated-LoRA offsets hook (one offset per row)",
}


def per_token_hook(hook):
    """``hook``, marked as acting on each position of a forward alike, whatever the forward's width and however
    often it is called (steering every position, an ablation, recording): a target carrying it is then run.
    ``module.register_forward_hook(speculative_kernels.per_token_hook(hook))``. It is the caller's assertion: a
    hook that reads the last position, counts calls or reads the last ``position_ids`` gives other tokens than
    model.generate (several tokens are verified per forward); recording hooks see those multi-token forwards,
    rejected tokens included."""
    try:
        setattr(hook, _MARK, True)
        return hook
    except (AttributeError, TypeError):  # a bound method, or an object without a __dict__: wrapped
        @functools.wraps(hook)
        def marked(*args, **kwargs):
            return hook(*args, **kwargs)

        setattr(marked, _MARK, True)
        return marked


def _name(hook) -> str:
    function = getattr(hook, "func", hook)  # functools.partial
    return getattr(function, "__qualname__", None) or type(function).__qualname__


def _per_token(hook) -> bool:
    function = getattr(hook, "func", hook)
    if getattr(hook, _MARK, False) or getattr(function, _MARK, False):
        return True
    module = getattr(function, "__module__", None) or type(function).__module__
    if module.startswith("speculative_kernels."):  # our own runners' hooks (seq2seq positions), inside a forward
        return True
    return (module, _name(function)) in _KNOWN_PER_TOKEN or (type(function).__module__, type(function).__qualname__) \
        in _KNOWN_PER_TOKEN


def neftune_alpha(module) -> float | None:
    """The noise scale of NEFTune's forward hook on ``module`` (``transformers.integrations.neftune``:
    ``activate_neftune``, the Trainer's ``neftune_noise_alpha``), or None: in training mode it adds uniform noise to
    the embeddings at every forward, so the forward is random (in eval mode it returns them unchanged)."""
    if any(getattr(hook, "__module__", None) == "transformers.integrations.neftune"
           and _name(hook) == "neftune_post_forward_hook" for hook in module._forward_hooks.values()):
        return getattr(module, "neftune_noise_alpha", None)
    return None


def unmarked_hooks(model) -> list[str]:
    """"module (kind hook)" for each forward hook or pre-hook on ``model``'s modules, and each global module hook,
    that is not known or marked to act per position."""
    found = []
    for name, module in model.named_modules():
        for kind, hooks in (("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks)):
            found += [f"{name or 'model'} ({kind} {_name(hook)})" for hook in hooks.values() if not _per_token(hook)]
    module_hooks = torch.nn.modules.module
    for kind, hooks in (("global forward pre-hook", module_hooks._global_forward_pre_hooks),
                        ("global forward hook", module_hooks._global_forward_hooks)):
        found += [f"every module ({kind} {_name(hook)})" for hook in hooks.values() if not _per_token(hook)]
    return found


def _row_hook(hook) -> str | None:
    """What a hook of ``_PER_ROW`` is, or None for any other hook."""
    function = getattr(hook, "func", hook)
    module = getattr(function, "__module__", None) or ""
    return _PER_ROW.get(_name(function)) if module.startswith("peft.") else None


def row_hooks_reason(model) -> str | None:
    """Why ``model`` (target or draft) is ruled out by a hook that routes each row by its index in the batch
    (``_PER_ROW``), or None."""
    for name, module in model.named_modules():
        for hook in module._forward_pre_hooks.values():
            what = _row_hook(hook)
            if what is not None:
                return (f"it carries {what} on {name or 'model'}: each row of a forward runs what the hook holds for "
                        "its index in the batch, and speculative decoding's forwards do not hold the caller's rows in "
                        "the caller's order (finished rows leave the batch, rows are prefilled apart), so a row would "
                        "run another row's adapter. Generate each adapter's rows in a call of their own "
                        "(set_adapter), or use model.generate")
    return None


def hooks_reason(model) -> str | None:
    """Why the target's hooks rule it out (``unmarked_hooks``), or None."""
    found = unmarked_hooks(model)
    if not found:
        return None
    names = ", ".join(found[:4]) + (f", and {len(found) - 4} more" if len(found) > 4 else "")
    return (f"it carries forward hooks that may change its outputs ({names}): speculative decoding verifies several "
            "tokens per forward where model.generate runs one, so a hook that acts on the last position (logits[:, "
            "-1], out[0][:, -1] += v), counts its calls or reads the last position_ids acts on other tokens "
            "(other output, silently); a hook that acts on every position alike (steering all positions, an "
            "ablation, recording) is exact: register it as speculative_kernels.per_token_hook(hook), remove it, or "
            "put it on the draft model (a draft's hooks change only which tokens are accepted)")
