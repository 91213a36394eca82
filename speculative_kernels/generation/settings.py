"""Resolve ``generate`` keyword arguments into one validated plan, with HF's own precedence rules.

The target model's ``_prepare_generation_config`` merges, as ``model.generate`` does, the explicit keywords over the
given ``generation_config`` over the model's ``generation_config`` over HF's global defaults. Every setting is then
either honoured exactly or refused with a ``ValueError`` naming it: nothing is silently ignored.
"""

import dataclasses
import numbers

import torch

from ..ops.validation import check_sampling_params

# GenerationConfig fields we cannot honour exactly, with the value that means "off".
_UNSUPPORTED_UNLESS = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "constraints": None,
    "sequence_bias": None,
    "min_p": None,
    "top_h": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "penalty_alpha": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "output_attentions": False,
    "output_hidden_states": False,
    "max_time": None,
    "stop_strings": None,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
    "dola_layers": None,
    "low_memory": None,
}
_REASONS = {
    "num_beams": "beam search is not speculative sampling",
    "num_return_sequences": "repeat the prompt in the batch instead",
    "output_attentions": "attention maps of the speculative forwards do not match per-step ones",
    "output_hidden_states": "hidden states of the speculative forwards do not match per-step ones",
}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    temperature: float
    top_k: int
    top_p: float

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass
class Plan:
    """Everything the loop needs, validated."""

    sampling: Sampling
    num_speculative_tokens: int | str  # or "auto"
    max_new_tokens: int
    min_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    return_dict_in_generate: bool
    output_scores: bool
    output_logits: bool
    streamer: object | None
    stopping_criteria: list
    cache_implementation: str | None
    generation_config: object


def _int_list(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.flatten().tolist())
    if isinstance(value, numbers.Integral):
        return (int(value),)
    return tuple(int(v) for v in value)


def _check_unsupported(config) -> None:
    for name, off in _UNSUPPORTED_UNLESS.items():
        value = getattr(config, name, off)
        if value is None and off is not None:
            continue
        if value != off and not (off is None and value in ((), [], {})):
            why = _REASONS.get(name, "it cannot be applied exactly across a speculative block")
            raise ValueError(f"{name}={value!r} is not supported by speculative_kernels.generate ({why})")
    if config.use_cache is False:
        raise ValueError("use_cache=False is not supported: speculative decoding rolls back the KV cache")


def _check_gamma(num_speculative_tokens) -> int | str:
    if isinstance(num_speculative_tokens, str) and num_speculative_tokens == "auto":
        return "auto"  # the loop calibrates and chooses gamma (gamma.py)
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, numbers.Integral):
        raise TypeError(
            f"num_speculative_tokens must be an int or 'auto', got {type(num_speculative_tokens).__name__}")
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    return int(num_speculative_tokens)


def resolve_plan(model, prompt_length: int, num_speculative_tokens, generation_config, kwargs: dict):
    """(Plan, leftover model kwargs). kwargs: everything ``generate`` received besides models and input_ids."""
    streamer = kwargs.pop("streamer", None)
    stopping_criteria = kwargs.pop("stopping_criteria", None)
    logits_processor = kwargs.pop("logits_processor", None)
    if logits_processor:
        raise ValueError("logits_processor is not supported: pass temperature/top_k/top_p/min_new_tokens instead")
    for name in ("prefix_allowed_tokens_fn", "synced_gpus", "negative_prompt_ids", "negative_prompt_attention_mask"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"{name} is not supported by speculative_kernels.generate")
    zero_new = kwargs.get("max_new_tokens") == 0  # HF refuses 0; here it means "return the prompt"
    if zero_new:
        kwargs["max_new_tokens"] = 1
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if zero_new:
        config.max_new_tokens = 0
    _check_unsupported(config)

    if config.do_sample:
        sampling = Sampling(*check_sampling_params(config.temperature, config.top_k or 0, config.top_p))
        if sampling.temperature == 0.0:
            raise ValueError("do_sample=True needs temperature > 0 (use do_sample=False for greedy decoding)")
    else:
        sampling = Sampling(0.0, 0, 1.0)

    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_new = config.max_length - prompt_length
    if max_new < 0:
        raise ValueError(
            f"max_length={config.max_length} is shorter than the prompt ({prompt_length} tokens); "
            "set max_new_tokens instead"
        )
    min_new = max(config.min_new_tokens or 0, (config.min_length or 0) - prompt_length, 0)
    eos = _int_list(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    criteria = list(stopping_criteria) if stopping_criteria else []
    if config.cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(
            f"cache_implementation={config.cache_implementation!r} is not supported; use 'dynamic' (default) or 'static'"
        )
    plan = Plan(
        sampling=sampling,
        num_speculative_tokens=_check_gamma(num_speculative_tokens),
        max_new_tokens=int(max_new),
        min_new_tokens=int(min_new),
        eos_token_ids=eos,
        pad_token_id=pad,
        return_dict_in_generate=bool(config.return_dict_in_generate),
        output_scores=bool(config.output_scores),
        output_logits=bool(config.output_logits),
        streamer=streamer,
        stopping_criteria=criteria,
        cache_implementation=config.cache_implementation,
        generation_config=config,
    )
    return plan, model_kwargs
