"""Models wrapped by PEFT (``peft.PeftModel``, or its tuner, e.g. ``LoraModel``): driven through the transformers
model inside, where that is the wrapper's own forward.

PEFT's tuners (LoRA, IA3, LoHa, OFT, ...) inject their layers into the transformers model in place, and the
wrapper's forward only calls that model's; ``model.generate`` on the wrapper runs the inner model's ``generate``.
So the inner model, driven directly, computes exactly what the wrapper computes. Three kinds of adapter change the
forward itself and are refused by name: prompt learning (prompt/prefix/p-tuning: virtual tokens or a prefix KV
cache the wrapper prepends), activated LoRA (the wrapper computes each row's offsets from the prompt) and Poly (the
wrapper passes ``task_ids``); prompt learning inside ``disable_adapter()`` is driven (the wrapper's forward is then
the base model's). peft is not imported: its wrappers are recognised by their class's module.

Every other tuner must be one audited as per-token (``PER_TOKEN_TUNERS``: each token's output computed from that
token alone, as the frozen layers compute it, so a verification forward over gamma + 1 tokens gives each the logits
of a one-token step). peft adds tuners in most releases, and some are not per-token (Lily averages its router over
every token of a forward; X-LoRA's wrapper runs a classifier pass that sets its scalings through hooks; Shadow
threads a paired KV cache through ``past_key_values``): an active adapter of a tuner not on the list, or a module
of one injected in the model (``peft.inject_adapter_in_model``, transformers' PEFT integration), is refused by name.
"""

import torch

# peft tuner packages (``peft.tuners.<name>``) audited as per-token with peft 0.21: token-identical to the wrapper's
# generate as a target, with weights perturbed so that they act; and peft's shared helper modules.
PER_TOKEN_TUNERS = frozenset({
    "adalora", "adaption_prompt", "beft", "boft", "c3a", "deft", "delora", "fourierft", "frod", "glora", "gralora",
    "hira", "hra", "ia3", "ln_tuning", "loha", "lokr", "lora", "miss", "mixed", "oft", "osf", "peanut", "psoft",
    "pvera", "randlora", "road", "shira", "supertuning", "tinylora", "trainable_tokens", "unilora", "vblora", "vera",
    "waveft", "tuners_utils", "lycoris_utils", "_buffer_dict"})
_NOT_PER_TOKEN = {
    "lily": "Lily mixes its experts by router probabilities averaged over every token of a forward, so a "
            "verification forward over several tokens mixes them otherwise than model.generate's one-token steps",
    "xlora": "X-LoRA's wrapper runs a classifier pass that sets its experts' scalings through hooks of its own "
             "forward, which the transformers model inside does not run",
    "shadow": "Shadow threads a paired shadow KV cache through past_key_values, which speculative decoding's own "
              "caches are not",
}


def _is_peft_wrapper(model) -> bool:
    """A class of peft's own (a transformers model with adapters loaded by its PEFT integration is not one: its
    forward is the model's, adapters included)."""
    return type(model).__module__.split(".")[0] == "peft" and isinstance(getattr(model, "peft_config", None), dict)


def _inner_model(model):
    """The transformers model a PeftModel (``get_base_model``) or a tuner (``.model``) wraps."""
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model.model


def _refusal(config) -> str | None:
    """Why an adapter with this config cannot be driven through the inner model, or None."""
    if getattr(config, "is_prompt_learning", False):
        return "prompt learning prepends virtual tokens (or a prefix KV cache) in the wrapper's forward"
    if getattr(config, "alora_invocation_tokens", None):
        return "activated LoRA applies from offsets the wrapper computes from the prompt"
    tuner = str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1].lower()
    if tuner == "poly":
        return "Poly adapters are routed by task_ids the wrapper passes"
    return _tuner_reason(tuner)


def _tuner_reason(tuner: str) -> str | None:
    """Why peft's tuner package ``tuner`` (e.g. "lora") cannot be driven exactly, or None for an audited one."""
    if tuner in PER_TOKEN_TUNERS:
        return None
    return _NOT_PER_TOKEN.get(tuner, f"the {tuner!r} tuner is not one audited as per-token (each token's output from "
                                     "that token alone) by this version of speculative_kernels")


def _class_tuner_reason(obj) -> str | None:
    """Why the peft tuner package defining ``obj``'s class (``peft.tuners.<name>...``) cannot be driven exactly, or
    None (an audited tuner, or a class from elsewhere)."""
    parts = type(obj).__module__.split(".")
    return _tuner_reason(parts[2]) if parts[:2] == ["peft", "tuners"] and len(parts) > 2 else None


def _injected_tuner(model) -> tuple[str, str] | None:
    """(module name, reason) of a peft layer injected in ``model`` whose tuner is not per-token, or None."""
    for module_name, module in model.named_modules():
        why = _class_tuner_reason(module)
        if why is not None:
            return module_name, why
    return None


def unwrap_adapters(model, name: str = "model"):
    """``model``, or for a PEFT wrapper the transformers model whose forward the wrapper runs (its adapters active
    as set on the wrapper: ``set_adapter``, ``disable_adapter()``, ... act on the injected layers). ValueError
    naming an active adapter that changes the forward itself."""
    if model is None or (type(model).__name__ == "OptimizedModule"
                         and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module)):
        return model  # (a torch.compile wrapper: check_models refuses it, naming _orig_mod to pass instead)
    if not _is_peft_wrapper(model):  # (a transformers model: peft layers may be injected without a wrapper)
        injected = _injected_tuner(model) if isinstance(model, torch.nn.Module) else None
        if injected is not None:
            raise ValueError(f"{name} holds a PEFT module {type(model.get_submodule(injected[0])).__name__} at "
                             f"{injected[0]!r}, which speculative_kernels cannot drive exactly ({injected[1]}); merge "
                             "it where PEFT can, or use model.generate")
        return model
    active = model.active_adapters
    active = active() if callable(active) else active
    for adapter in [active] if isinstance(active, str) else list(active):
        config = model.peft_config.get(adapter)
        if getattr(config, "is_prompt_learning", False) and getattr(model, "_adapters_disabled", False):
            continue  # (inside disable_adapter(): the wrapper's forward is the base model's)
        why = _refusal(config)
        if why is not None:
            fix = ("it has no weights to merge: use model.generate" if getattr(config, "is_prompt_learning", False)
                   else f"merge it ({name}.merge_and_unload()) where PEFT can, or use model.generate")
            raise ValueError(f"{name} is a PEFT {type(model).__name__} with the {type(config).__name__} adapter "
                             f"{adapter!r}, which speculative_kernels cannot drive exactly ({why}); {fix}")
    tuner_model = getattr(model, "base_model", model)  # (a PeftModel's tuner model, e.g. X-LoRA's; a tuner: itself)
    why = _class_tuner_reason(tuner_model)
    if why is not None:
        raise ValueError(f"{name} is a PEFT {type(model).__name__} driven by {type(tuner_model).__name__}, which "
                         f"speculative_kernels cannot drive exactly ({why}); merge it where PEFT can, or use "
                         "model.generate")
    _hand_over_generation_config(model)
    return unwrap_adapters(_inner_model(model), name)


def _hand_over_generation_config(wrapper) -> None:
    """A generation_config set on a PeftModelForCausalLM itself (``peft_model.generation_config = ...``; reading it
    otherwise reads the inner model's): its generate assigns it to ``base_model.model`` (the transformers model inside
    a tuner) at every call, so it is the one that applies. Done here too, to the same module, with the same lasting
    effect (peft does not restore the one it replaced). HF's assisted generation runs an assistant through its own
    generate, so a draft's is handed over alike."""
    own = vars(wrapper).get("generation_config")
    hands_over = any(klass.__name__ == "PeftModelForCausalLM" and klass.__module__.split(".")[0] == "peft"
                     for klass in type(wrapper).__mro__)
    if hands_over and own is not None:
        holder = getattr(wrapper.base_model, "model", wrapper.base_model)  # (as peft's generate picks it)
        if getattr(holder, "generation_config", None) is not own:
            holder.generation_config = own


def _adapters_idle(module) -> bool:
    """Whether a peft layer's forward runs its base layer alone: its adapters disabled or merged (peft's
    ``if self.disable_adapters: ... elif self.merged: result = self.base_layer(x)``)."""
    return bool(getattr(module, "disable_adapters", False) or getattr(module, "merged", False))


def idle_adapter_modules(model) -> set[int]:
    """ids of the modules of ``model`` that sit in a peft layer whose adapters are disabled or merged, outside its
    base layer: never called (their dropout, e.g. ``lora_dropout``, draws nothing)."""
    idle = set()
    for module in model.modules():
        if type(module).__module__.split(".")[0] != "peft" or not _adapters_idle(module):
            continue
        base = getattr(module, "base_layer", None)
        kept = {id(m) for m in base.modules()} if isinstance(base, torch.nn.Module) else set()
        idle.update(id(m) for m in module.modules() if m is not module and id(m) not in kept)
    return idle


def _active_values(module, attribute: str) -> list:
    """The values of a peft layer's per-adapter dict ``attribute`` for its active adapters (none when its adapters
    are disabled or merged: its forward then runs the base layer alone, which draws nothing)."""
    values = getattr(module, attribute, None)  # (a dict, a ParameterDict or a ModuleDict)
    if not callable(getattr(values, "keys", None)) or _adapters_idle(module):
        return []
    return [values[name] for name in getattr(module, "active_adapters", ()) if name in values]


def adapter_randomness(module) -> str | None:
    """What makes a peft layer's forward random where torch's dropout modules do not show it ("rank_dropout=0.5"),
    or None: in training mode LyCORIS' rank and module dropout (LoHa, LoKr: floats per adapter), PVeRA's sampled
    projection and MonteCLoRA's sampled weights; PVeRA with sample_at_inference=True in any mode."""
    if type(module).__module__.split(".")[0] != "peft":
        return None
    if any(_active_values(module, "sample_at_inference")):
        return "sample_at_inference=True (PVeRA draws its projection at every forward, also in eval mode)"
    if not module.training:
        return None
    for attribute in ("rank_dropout", "module_dropout"):
        p = max((v for v in _active_values(module, attribute) if isinstance(v, float)), default=0.0)
        if p > 0:
            return f"{attribute}={p}"
    if _active_values(module, "pvera_lambda_d"):
        return "PVeRA's sampled projection"
    if _active_values(module, "lora_monteclora_sampler"):
        return "MonteCLoRA's sampled weights"
    return None
