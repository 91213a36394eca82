"""Models wrapped by PEFT (``peft.PeftModel``, or its tuner, e.g. ``LoraModel``): driven through the transformers
model inside, where that is the wrapper's own forward.

PEFT's tuners (LoRA, IA3, LoHa, OFT, ...) inject their layers into the transformers model in place, and the
wrapper's forward only calls that model's; ``model.generate`` on the wrapper runs the inner model's ``generate``.
So the inner model, driven directly, computes exactly what the wrapper computes. Three kinds of adapter change the
forward itself and are refused by name: prompt learning (prompt/prefix/p-tuning: virtual tokens or a prefix KV
cache the wrapper prepends), activated LoRA (the wrapper computes each row's offsets from the prompt) and Poly (the
wrapper passes ``task_ids``). peft is not imported: its wrappers are recognised by their class's module.
"""


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
    if str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1] == "POLY":
        return "Poly adapters are routed by task_ids the wrapper passes"
    return None


def unwrap_adapters(model, name: str = "model"):
    """``model``, or for a PEFT wrapper the transformers model whose forward the wrapper runs (its adapters active
    as set on the wrapper: ``set_adapter``, ``disable_adapter()``, ... act on the injected layers). ValueError
    naming an active adapter that changes the forward itself."""
    if model is None or not _is_peft_wrapper(model):
        return model
    active = model.active_adapters
    active = active() if callable(active) else active
    for adapter in [active] if isinstance(active, str) else list(active):
        config = model.peft_config.get(adapter)
        why = _refusal(config)
        if why is not None:
            raise ValueError(f"{name} is a PEFT {type(model).__name__} with the {type(config).__name__} adapter "
                             f"{adapter!r}, which speculative_kernels cannot drive exactly ({why}); merge it "
                             f"({name}.merge_and_unload()) where PEFT can, or use model.generate")
    return unwrap_adapters(_inner_model(model), name)
