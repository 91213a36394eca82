"""Resolve ``generate`` keyword arguments into validated settings and a plan, with HF's own precedence rules.

The target model's ``_prepare_generation_config`` merges, as ``model.generate`` does, the explicit keywords over the
given ``generation_config`` over the model's ``generation_config`` over HF's global defaults. Every field of
``GenerationConfig`` is then in exactly one of the tables below (``tests/generation/test_contract.py`` enumerates the
installed transformers' fields, so a new field cannot slip through unclassified):

* ``HONOURED``: applied exactly as ``model.generate`` applies it; the fields of ``CONTEXT_PROCESSED`` among them by
  HF's own logits processors, run at every position of a speculative block (``context_processors.py``);
* ``NO_EFFECT``: fields ``model.generate`` itself ignores in greedy/sampling decoding (beam-search-only settings, the
  config's own metadata), so accepting them changes nothing;
* ``REFUSED_UNLESS``: settings we cannot honour exactly; any value but "off" (or HF's own default) raises
  ``ValueError`` naming the field.

A field of the installed ``GenerationConfig`` that is in none of them (a newer transformers) is refused by name as
soon as it is set.
"""

import dataclasses
import functools
import inspect
import math
import numbers
import warnings

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.utils import logging as hf_logging

from ..ops.sampling import GREEDY, Sampling
from ..ops.validation import check_sampling_params
from .gamma import MAX_GAMMA

# model.generate's logger: its warnings are given through it here too, so transformers' verbosity settings govern
# both alike
HF_LOGGER = hf_logging.get_logger("transformers.generation.utils")
# and its stopping criteria's (``MaxLengthCriteria`` gives the reminder about max_position_embeddings)
HF_CRITERIA_LOGGER = hf_logging.get_logger("transformers.generation.stopping_criteria")

DEFAULT_NUM_SPECULATIVE_TOKENS = 5
# transformers' deprecated names of its static cache (``DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS`` less the offloaded
# ones, whose memory placement we do not do, and "hybrid", which ``_prepare_generation_config`` itself unsets).
STATIC_ALIASES = ("sliding_window", "hybrid_chunked")
DEFAULT_MAX_MATCHING_NGRAM_SIZE = 2  # HF's (``generation_config.max_matching_ngram_size or 2``)
_TOKEN_ID_FIELDS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "forced_bos_token_id",
                    "forced_eos_token_id")

# Applied as model.generate applies them (where: this module, the loop, seq2seq_inputs.py).
HONOURED = {
    "max_length": "length (HF's default of 20 new tokens when unset, capped at max_position_embeddings)",
    "max_new_tokens": "length",
    "min_length": "EOS masked before it",
    "min_new_tokens": "EOS masked before it; when set, min_length is ignored (HF overwrites it)",
    "do_sample": "greedy or sampling",
    "temperature": "warping",
    "top_k": "warping",
    "top_p": "warping",
    "eos_token_id": "stops a row",
    "pad_token_id": "fills finished rows",
    "bos_token_id": "starts an empty prompt",
    "decoder_start_token_id": "starts the decoder (encoder-decoder)",
    "forced_bos_token_id": "forced first token",
    "forced_eos_token_id": "forced last token",
    "use_cache": "must be True (the KV cache is rolled back)",
    "return_dict_in_generate": "output class",
    "output_scores": "scores",
    "output_logits": "logits",
    "cache_implementation": "'dynamic' or 'static' (and transformers' deprecated names of its static cache, "
                            "'sliding_window' and 'hybrid_chunked', as 'static'; 'hybrid' HF itself unsets)",
    "num_assistant_tokens": "gamma when num_speculative_tokens is not given",
    "num_assistant_tokens_schedule": "'constant' only (gamma fixed, or num_speculative_tokens='auto')",
    "prompt_lookup_num_tokens": "drafts by prompt lookup instead of a draft model: the most tokens a row proposes",
    "max_matching_ngram_size": "prompt lookup's longest n-gram (HF's default 2)",
    "assistant_early_exit": "the target's first N decoder layers, its final norm and LM head draft (early_exit.py; "
                            "decoder-only models)",
    "num_return_sequences": "sampling: each prompt repeated, its rows together (HF refuses it greedy, and so do we)",
    "stop_strings": "HF's StopStringCriteria on the call's tokenizer=, per row (a row stops after the token that "
                    "completes one), any batch size",
    "max_time": "every row stops after the iteration in which max_time seconds have passed since the prefill began "
                "(HF: after the step): a prefix of the output, as HF's",
    "assistant_lookbehind": "a draft with another tokenizer (retokenize.py): the draft tokens decoded with each "
                            "proposal's (HF's default 10); refused when set otherwise without such a draft",
    "target_lookbehind": "a draft with another tokenizer (retokenize.py): the target tokens decoded with the new ones "
                         "before the draft's are re-encoded (HF's default 10); refused when set otherwise without "
                         "such a draft",
    "prefill_chunk_size": "HF's chunked prefill: every prefill of the prompts (the target's, the draft model's, an "
                          "encoder-decoder's decoder prompt) runs in forwards of at most this many tokens "
                          "(``runners.prefill``)",
}
# Field -> its "off" values. Honoured by HF's own logits processors, which read the tokens so far, run at every
# position of a speculative block with the tokens before it (``context_processors.py``); part of ``HONOURED``.
CONTEXT_PROCESSED = {
    "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "bad_words_ids": (),
    "sequence_bias": (),
    "suppress_tokens": (),
    "begin_suppress_tokens": (),
    "exponential_decay_length_penalty": (),
    "remove_invalid_values": (False,),
}
HONOURED.update({name: "HF's logits processor, at every position of a speculative block (context_processors.py)"
                 for name in CONTEXT_PROCESSED})
HONOURED["renormalize_logits"] = "scores are log-softmax normalised last, as HF's LogitNormalization"
HONOURED["watermarking_config"] = ("HF's WatermarkLogitsProcessor (Kirchenbauer et al.; a function of the tokens so "
                                   "far), at every position of a speculative block, after the warpers as in HF; "
                                   "SynthID's, which keeps state from call to call, is refused")
# Field -> its "off" values. HF's sampling warpers after temperature/top-k/top-p: when one is set and do_sample is
# True, HF's whole warper chain runs on the logits before the verification (which then warps nothing itself); with
# do_sample False they change nothing, as in model.generate. Part of ``HONOURED``.
WARPERS = {
    "min_p": (),
    "top_h": (),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
}
HONOURED.update({name: "HF's sampling warper (sampling only, as in HF), before the verification"
                 for name in WARPERS})
# Ignored by model.generate too in greedy/sampling decoding (num_beams is always 1 here), or metadata.
NO_EFFECT = {
    "early_stopping": "beam search only",
    "length_penalty": "beam search only",
    "num_beam_groups": "group beam search only (num_beams > 1 is refused)",
    "diversity_penalty": "group beam search only (num_beams > 1 is refused)",
    "low_memory": "beam search only (HF raises there since its refactor; greedy and sampling ignore it)",
    "transformers_version": "metadata",
    "_from_model_config": "metadata",
    "disable_compile": "speculative_kernels never compiles on its own (see compile=)",
}
# Field -> the values that mean "off". HF's global default for the field (``_get_default_generation_params``) is
# accepted too: a value nobody set changes nothing.
REFUSED_UNLESS = {
    "num_beams": (1,),
    "force_words_ids": (),
    "constraints": (),
    "penalty_alpha": (0.0,),  # (0: HF's greedy search)
    "guidance_scale": (1.0,),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
    "token_healing": (False,),
    "dola_layers": (),
    "use_mtp": (False,),
    "assistant_confidence_threshold": (),
    "is_assistant": (False,),
    "assistant_ensemble_weight": (),
    "cache_config": (),
    "max_cache_len": (),
    "compile_config": (),
    "continuous_batching_config": (),
    "speculation_type": (),
}
_REASONS = {
    "num_beams": "beam search is not speculative sampling",
    "output_attentions": "attention maps of the speculative forwards do not match per-step ones",
    "output_hidden_states": "hidden states of the speculative forwards do not match per-step ones",
    "token_healing": "it rewrites the prompt",
    "use_mtp": "multi-token prediction is another drafting method",
    "assistant_confidence_threshold": "HF's draft-confidence stopping is not implemented; gamma is fixed, or "
                                      "num_speculative_tokens='auto'",
    "is_assistant": "model.generate then runs as an assistant: it adds HF's draft-confidence stopping criterion "
                    "(assistant_confidence_threshold, default 0.4)",
    "assistant_ensemble_weight": "an ensemble of draft and target is not the target's distribution",
    "cache_config": "the caches are speculative_kernels' own (cache_implementation='dynamic' or 'static')",
    "max_cache_len": "the static cache is sized by speculative_kernels",
    "compile_config": "pass compile=True or a CompileOptions instead",
    "continuous_batching_config": "continuous batching is not implemented; see SpeculativeDecoder",
    "speculation_type": "HF's other speculation methods are not implemented; pass draft_model=",
}


# Model inputs model.generate passes on to the forward that we refuse, and why (appended to the error).
_MULTIMODAL = ("generating from images, audio or video is not supported (multimodal models generate from text "
               "here)")
_MODEL_INPUT_HINTS = {
    "inputs_embeds": "inputs_embeds is not supported: the draft and the drafters read token ids (pass input_ids)",
    "pixel_values": _MULTIMODAL,
    "pixel_values_videos": _MULTIMODAL,
    "input_features": _MULTIMODAL,
    "position_ids": "position_ids are computed from attention_mask, as model.generate computes them",
    "token_type_ids": "token_type_ids are not passed on to the model's forward",
    "adapter_names": "PEFT's adapter_names (one adapter per row) is not supported: its hooks give each row the "
                     "adapter at its index in the batch, and the speculative forwards do not keep the caller's rows in "
                     "order; generate each adapter's rows in a call of their own (peft_model.set_adapter(name))",
}


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Prompt-lookup drafting (HF's ``prompt_lookup_num_tokens``, ``max_matching_ngram_size``)."""

    num_tokens: int
    max_ngram: int


@dataclasses.dataclass(frozen=True)
class Lookbehind:
    """HF's ``assistant_lookbehind`` and ``target_lookbehind`` (ints >= 0; 10, HF's default, where unset), used by a
    draft with another tokenizer (``retokenize.py``); ``given``: the fields set to another value than HF's default
    (refused without such a draft: they would change nothing)."""

    assistant: int = 10
    target: int = 10
    given: tuple[str, ...] = ()


@dataclasses.dataclass
class Plan:
    """Everything the loop needs, validated (``Settings.plan``)."""

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
    # HF's logits processors that read the tokens so far (``context_processors.py``): the user's list, the
    # prefix_allowed_tokens_fn, and whether any is to run (one of those, or a field of ``CONTEXT_PROCESSED`` set).
    logits_processor: tuple = ()
    prefix_allowed_tokens_fn: object | None = None
    context_processing: bool = False
    renormalize_logits: bool = False
    stop_strings: tuple = ()  # HF's stop_strings (``StopStringCriteria`` on the call's tokenizer)
    max_time: float | None = None  # seconds: every row stops after the iteration in which they have passed
    # HF's warper chain runs before the verification (a field of ``WARPERS`` set, sampling); ``sampling`` is then
    # neutral (temperature 1, no top-k/top-p): the chain applies the request's own.
    warping: bool = False
    # HF's WatermarkLogitsProcessor runs (``watermarking_config``): last in each row's list, after the warpers when
    # sampling (the rows' lists then hold HF's whole chain: ``context_processors.build_row_processors``).
    watermark: bool = False
    # num_speculative_tokens as the request set it, where build_loop capped num_speculative_tokens at what its
    # iterations can draft (None: not capped)
    gamma_setting: int | None = None
    # the target's config.max_position_embeddings (None: it has none), for HF's reminder past it
    # (``remind_past_positions``)
    max_position_embeddings: int | None = None
    # HF's prefill_chunk_size: the most tokens of one prefill forward (None: the whole prompt in one)
    prefill_chunk_size: int | None = None

    @property
    def processors_warp(self) -> bool:
        """Sampling with a watermark: each row's processor list is HF's whole chain (its warpers, then the watermark,
        which reads the tokens so far), so nothing warps the target's logits after it."""
        return self.watermark and bool(self.generation_config.do_sample)

    @property
    def max_gamma(self) -> int:
        """The largest gamma an iteration may draft (buffers are sized for it): the fixed one, or the calibration's
        upper bound with "auto"."""
        return MAX_GAMMA if self.num_speculative_tokens == "auto" else self.num_speculative_tokens


def _hf_defaults() -> dict:
    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    return getter() if callable(getter) else {}


def generation_fields() -> set[str]:
    """The fields of the installed transformers' ``GenerationConfig``."""
    return set(GenerationConfig().to_dict())


def classified_fields() -> set[str]:  # (CONTEXT_PROCESSED and WARPERS are in HONOURED)
    return set(HONOURED) | set(NO_EFFECT) | set(REFUSED_UNLESS)


def _is_off(value, off: tuple, default) -> bool:
    if value is None or (isinstance(value, (list, tuple, dict, set)) and not value):
        return True
    return value in off or (default is not None and value == default)


def _check_refused(config, check_schedule: bool = True, from_model: frozenset = frozenset()) -> None:
    """ValueError for settings that cannot be applied exactly. check_schedule: False for a schedule that only the
    target's generation_config sets while the call gives num_speculative_tokens or uses prompt lookup (HF's assisted
    generation reads the draft's schedule, prompt lookup none: the target's has no effect there either); the call's
    own schedule is always checked. from_model: the fields whose value is the model's generation_config's (the
    message says so: a checkpoint's generation_config.json sets them, e.g. BART-large-cnn's num_beams=4)."""
    defaults = _hf_defaults()
    for name, off in REFUSED_UNLESS.items():
        value = getattr(config, name, None)
        if not _is_off(value, off, defaults.get(name)):
            why = _REASONS.get(name, "it cannot be applied exactly across a speculative block")
            source = (f"; it is the model's generation_config's (as a checkpoint's generation_config.json sets it): "
                      f"pass {name}={off[0] if off else None!r} in the call to decode without it (model.generate "
                      "applies it)" if name in from_model else "")
            raise ValueError(f"{name}={value!r} is not supported by speculative_kernels.generate ({why}){source}")
    known = classified_fields()
    for name in sorted(generation_fields() - known):  # a field of a newer transformers, not yet classified here
        value = getattr(config, name, None)
        if value is not None and value != defaults.get(name):
            raise ValueError(f"{name}={value!r} is a generation setting speculative_kernels does not know yet; "
                             "it cannot promise to honour it exactly, so it refuses it")
    watermark = getattr(config, "watermarking_config", None)
    if watermark is not None and type(watermark).__name__ != "WatermarkingConfig":
        raise ValueError(f"watermarking_config={type(watermark).__name__} is not supported: its logits processor keeps "
                         "state from call to call, which the calls at rejected positions of a speculative block would "
                         "advance; WatermarkingConfig (Kirchenbauer et al.) is supported")
    if config.use_cache is False:
        raise ValueError("use_cache=False is not supported: speculative decoding rolls back the KV cache (a "
                         "checkpoint saved after training with gradient checkpointing often carries it in config.json "
                         "or generation_config.json: pass use_cache=True, which gives the same tokens)")
    schedule = config.num_assistant_tokens_schedule
    if schedule not in (None, "constant") and check_schedule:
        raise ValueError(f"num_assistant_tokens_schedule={schedule!r} is not supported (gamma is constant here): "
                         "set it to 'constant' (or leave it unset), and pass num_speculative_tokens (an int, or "
                         "'auto' to have gamma chosen from the measured acceptance and costs)")
    if config.cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(f"cache_implementation={config.cache_implementation!r} is not supported; use 'dynamic' "
                         "(default) or 'static'")


def token_ids(name: str, value) -> tuple[int, ...]:
    """eos_token_id-like values (an id, a list of ids, an integer tensor or numpy array) -> a tuple of ids >= 0.

    Integral floats (65.0) are ids as in model.generate; strings, bools and fractional numbers are refused by name.
    """
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got a {value.dtype} tensor")
        items = value.flatten().tolist()
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif hasattr(value, "ndim") and callable(getattr(value, "reshape", None)):  # numpy: an array or a scalar
        items = value.reshape(-1).tolist()
    else:
        items = [value]
    ids = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, numbers.Real) or isinstance(item, complex):
            raise TypeError(f"{name} must be a token id (int) or a list of them, got {value!r}")
        if not float(item).is_integer():
            raise TypeError(f"{name} must be a token id (int) or a list of them, got {value!r}")
        if item < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
        ids.append(int(item))
    return tuple(ids)


def _length(name: str, value, *, allow_zero: bool = True) -> int | float:
    """A length setting: an int, or a real number as model.generate takes it (generation stops once the length
    reaches it, so 5.5 new tokens are 6). Returns it unchanged (the caller rounds up)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be >= {0 if allow_zero else 1}, got {value!r}")
    return value


def _unwrap_scalar(value):
    """A 0-d real tensor (``lengths.max()``) as the Python number it holds, as model.generate takes a length; anything
    else unchanged (for ``_length`` to check)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
        return value.item()
    return value


def _int_setting(name: str, value) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_gamma(num_speculative_tokens, name: str = "num_speculative_tokens") -> int | str:
    if isinstance(num_speculative_tokens, str) and num_speculative_tokens == "auto":
        return "auto"  # the loop calibrates and chooses gamma (gamma.py)
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, numbers.Integral):
        raise TypeError(f"{name} must be an int or 'auto', got {type(num_speculative_tokens).__name__}")
    if num_speculative_tokens < 1:
        raise ValueError(f"{name} must be >= 1, got {num_speculative_tokens}")
    return int(num_speculative_tokens)


def _choose_gamma(num_speculative_tokens, given, defaults) -> int | str:
    """num_speculative_tokens if given; else HF's num_assistant_tokens from the first source that sets it: ``given``
    (the call's keyword, a generation_config passed to the call), then ``defaults`` (the target's and, where HF
    reads it, the draft's generation_config); else the default. num_speculative_tokens and a different
    num_assistant_tokens both given to the call: an error. A checkpoint's value yields to the call's, as every
    generation_config default does."""
    unset = GenerationConfig().num_assistant_tokens  # None in transformers 5 (the merge fills HF's 20 in later)
    explicit = next((v for v in given if v is not None and v != unset), None)
    assistant = next((v for v in [*given, *defaults] if v is not None and v != unset), None)
    if num_speculative_tokens is None:
        if assistant is None:
            return DEFAULT_NUM_SPECULATIVE_TOKENS
        return _check_gamma(assistant, "num_assistant_tokens")
    gamma = _check_gamma(num_speculative_tokens)
    if explicit is not None and gamma != explicit:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} and num_assistant_tokens={explicit!r} "
                         "disagree; pass one of them")
    return gamma


def _check_draft_schedule(draft_model, num_speculative_tokens) -> None:
    """HF's assisted generation takes its draft length and schedule from the draft's generation_config: a
    "heuristic" schedule there changes it while decoding (and, for "heuristic", keeps the last value in the draft's
    config for the next call). Gamma is constant here: with no num_speculative_tokens given (the draft's settings
    would decide it), such a schedule is refused by name rather than ignored."""
    schedule = getattr(getattr(draft_model, "generation_config", None), "num_assistant_tokens_schedule", None)
    if num_speculative_tokens is None and schedule not in (None, "constant"):
        raise ValueError(f"the draft model's generation_config.num_assistant_tokens_schedule={schedule!r} is not "
                         "supported (gamma is constant here): pass num_speculative_tokens (an int, or 'auto' to have "
                         "it chosen from the measured acceptance and costs), or set the draft's "
                         "generation_config.num_assistant_tokens_schedule = 'constant'")


def _check_generation_config(generation_config) -> None:
    """generation_config: the caller's (None or a GenerationConfig). A dict set as its ``watermarking_config``
    attribute (GenerationConfig converts dicts only in its constructor and as a keyword of generate) would fail
    inside HF with an AttributeError: a TypeError naming it instead. (On the model's own config HF converts it when
    it prepares the call's config, and applies it: so is it here.)"""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        hint = "; build one with GenerationConfig(**settings)" if isinstance(generation_config, dict) else ""
        raise TypeError(f"generation_config must be a transformers.GenerationConfig, got "
                        f"{type(generation_config).__name__}{hint}")
    watermark = getattr(generation_config, "watermarking_config", None)
    if watermark is not None and not hasattr(watermark, "construct_processor"):
        raise TypeError(f"watermarking_config must be a transformers WatermarkingConfig (a dict is converted when "
                        f"passed to GenerationConfig(...) or as a keyword), got {type(watermark).__name__}")


def _set_nowhere(name: str, model, generation_config, kwargs: dict) -> bool:
    """HF's test (``generate``, transformers 5.x) of a length setting ("max_length": set nowhere, HF generates 20
    *new* tokens; "min_length": for its warnings): not in the call, the passed generation_config or the model's."""
    return (kwargs.get(name) is None
            and (generation_config is None or getattr(generation_config, name) is None)
            and getattr(model.generation_config, name) is None)


def hf_warn(message: str, opening: str) -> None:
    """``warnings.warn(message, UserWarning)`` as model.generate gives it: from its module
    (``transformers.generation.utils``, at the line of the call whose text starts with ``opening``, in its warning
    registry), so that the caller's filters keyed on transformers' module (``filterwarnings("ignore",
    module="transformers")``), and "default"'s once per location, act on ours as on HF's."""
    from transformers.generation import utils as hf_utils

    registry = vars(hf_utils).setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, UserWarning, hf_utils.__file__, _hf_warning_line(opening),
                           module=hf_utils.__name__, registry=registry, module_globals=vars(hf_utils))


@functools.cache
def _hf_warning_line(opening: str) -> int:
    """The line of the ``warnings.warn(`` call in transformers' generation/utils.py whose message starts with
    ``opening`` (the line Python attributes HF's warning to); 0 where the source cannot be read or differs."""
    from transformers.generation import utils as hf_utils

    try:
        lines = inspect.getsource(hf_utils).splitlines()
    except (OSError, TypeError):
        return 0
    for number, line in enumerate(lines):
        if opening in line:
            for back in range(number, max(number - 4, -1), -1):
                if "warnings.warn(" in lines[back]:
                    return back + 1
    return 0


def _length_warnings(config, prompt_length: int, max_new: int, default_max_length: bool,
                     default_min_length: bool) -> None:
    """The warnings ``model.generate`` gives about the lengths (``_prepare_generated_length``,
    ``_validate_generated_length``), with its texts, through its logger or ``warnings`` as it gives them."""
    docs = ("Please refer to the documentation for more information. "
            "(https://huggingface.co/docs/transformers/main/en/main_classes/text_generation)")
    if config.max_new_tokens is not None and not default_max_length and config.max_length is not None:
        HF_LOGGER.warning(f"Both `max_new_tokens` (={config.max_new_tokens}) and `max_length`(={config.max_length}) "
                           f"seem to have been set. `max_new_tokens` will take precedence. {docs}")
    min_length = config.min_length
    if config.min_new_tokens is not None:
        if not default_min_length:
            HF_LOGGER.warning(f"Both `min_new_tokens` (={config.min_new_tokens}) and `min_length`(={config.min_length})"
                               f" seem to have been set. `min_new_tokens` will take precedence. {docs}")
        min_length = config.min_new_tokens + prompt_length
    max_length = prompt_length + max_new
    suffix = (" Generation will stop at the defined maximum length. You should decrease the minimum length and/or "
              "increase the maximum length.")
    if default_max_length:
        suffix += f" Note that `max_length` is set to {max_length}, its default value."
    if min_length is not None and min_length > max_length:
        hf_warn(f"Unfeasible length constraints: `min_length` ({min_length}) is larger than the maximum possible "
                f"length ({max_length})." + suffix, "Unfeasible length constraints: `min_length`")
    if config.min_new_tokens is not None and config.min_new_tokens + prompt_length > max_length:
        hf_warn(f"Unfeasible length constraints: `min_new_tokens` ({config.min_new_tokens}), when added to the "
                f"prompt length ({prompt_length}), is larger than the maximum possible length ({max_length})."
                + suffix, "Unfeasible length constraints: `min_new_tokens`")


def remind_past_positions(plan: Plan, prompt_length: int, longest: int) -> None:
    """model.generate's reminder (its ``MaxLengthCriteria``, once per process through its logger) that a sequence
    grew past the target's ``max_position_embeddings``: HF checks every length L from prompt_length + 1 to the
    sequence's (prompt_length + longest new tokens) and reminds at the first with L > max_position_embeddings and
    L < max_length (prompt_length + max_new_tokens: not at the last token)."""
    limit = plan.max_position_embeddings
    if limit is None:
        return
    if max(prompt_length + 1, limit + 1) <= min(prompt_length + longest, prompt_length + plan.max_new_tokens - 1):
        HF_CRITERIA_LOGGER.warning_once(  # (its text, transformers 5.17 to 5.24)
            "This is a friendly reminder - the current text generation call has exceeded the model's predefined "
            f"maximum length ({limit}). Depending on the model, you may observe "
            "exceptions, performance degradation, or nothing at all.")


def _max_new_tokens(model, config, prompt_length: int, default_max_length: bool) -> int:
    """New tokens to generate, as model.generate decides them (``_prepare_generated_length``): max_new_tokens if
    set; else, for HF's default max_length (20), 20 new tokens capped at max_position_embeddings (with HF's
    warning); else max_length - prompt length (a prompt as long as max_length is an error, as in HF)."""
    if config.max_new_tokens is not None:
        return math.ceil(_length("max_new_tokens", config.max_new_tokens))
    max_length = _length("max_length", config.max_length)
    if default_max_length:
        max_length = max_length + prompt_length
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions is not None:
            max_length = min(max_length, positions)
        hf_warn(f"Using the model-agnostic default `max_length` (={max_length}) to control the generation "
                "length. We recommend setting `max_new_tokens` to control the maximum length of the "
                "generation.", "Using the model-agnostic default `max_length`")
    if prompt_length >= max_length:
        name = "decoder_input_ids" if model.config.is_encoder_decoder else "input_ids"  # (max_length counts it)
        raise ValueError(f"Input length of {name} is {prompt_length}, but `max_length` is set to {max_length}; "
                         "increase max_length or, better, set max_new_tokens")
    return math.ceil(max_length - prompt_length)


def _check_callables(streamer, stopping_criteria) -> list:
    if streamer is not None and not (callable(getattr(streamer, "put", None))
                                     and callable(getattr(streamer, "end", None))):
        raise TypeError(f"streamer must have put() and end() methods (a transformers BaseStreamer), got "
                        f"{type(streamer).__name__}")
    return list(_callables("stopping_criteria", stopping_criteria, "a StoppingCriteriaList", "bool"))


def _callables(name: str, value, kind: str, returns: str) -> tuple:
    """A keyword holding a list (or tuple) of callables (input_ids, scores) -> ``returns``; None or empty: ()."""
    if not value:
        return ()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of callables ({kind}), got {type(value).__name__}")
    for item in value:
        if not callable(item):
            raise TypeError(f"{name} must hold callables (input_ids, scores) -> {returns}, got "
                            f"{type(item).__name__} {item!r}")
    return tuple(value)


def _check_builtin_criteria(criteria, eos_token_ids, max_length: int, config) -> None:
    """HF's ``_merge_criteria_processor_list``: a stopping criterion of the very type ``generate`` builds itself
    *replaces* that one (with HF's warning, given here too). A ``MaxLengthCriteria`` replaces the max_length criterion
    (so HF generates up to its length, even past max_length/max_new_tokens), an ``EosTokenCriteria`` the EOS
    criterion (the row stops at its ids, not at eos_token_id's). Ours run besides the built-in stops, which is the
    same only where the given one stops no later (a shorter MaxLengthCriteria) or stops at the same ids; anything
    else is refused by name."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxTimeCriteria, StopStringCriteria

    built = {MaxLengthCriteria} | ({EosTokenCriteria} if eos_token_ids else set()) | (
        {MaxTimeCriteria} if config.max_time is not None else set()) | (
        {StopStringCriteria} if config.stop_strings is not None else set())
    for criterion in criteria:
        if type(criterion) in built:
            HF_LOGGER.warning_once(
                f"A custom stopping criteria of type {type(criterion)} has been passed to `.generate()`, but it was "
                f"also created in `.generate()`, given its parameterization. The custom {type(criterion)} will take "
                f"precedence. Please check the docstring of {type(criterion)} to see related `.generate()` flags.")
        if type(criterion) is MaxLengthCriteria and criterion.max_length > max_length:
            raise ValueError(
                f"stopping_criteria holds a MaxLengthCriteria(max_length={criterion.max_length}), which transformers' "
                f"generate uses in place of its own max_length ({max_length}) criterion, generating past "
                "max_length/max_new_tokens; speculative_kernels cannot; pass max_length= or max_new_tokens= instead")
        if type(criterion) is EosTokenCriteria and eos_token_ids:
            ids = set(token_ids("EosTokenCriteria.eos_token_id", criterion.eos_token_id))
            if ids != set(eos_token_ids):
                raise ValueError(
                    f"stopping_criteria holds an EosTokenCriteria with ids {sorted(ids)}, which transformers' "
                    f"generate uses in place of eos_token_id={list(eos_token_ids)} for stopping rows; "
                    "speculative_kernels cannot; pass eos_token_id= instead")


@dataclasses.dataclass(frozen=True)
class Settings:
    """A call's generation settings, validated, before the (decoder) prompt's length is known
    (``resolve_settings``); ``plan`` adds the lengths."""

    config: GenerationConfig
    sampling: Sampling
    num_speculative_tokens: int | str
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    streamer: object | None
    stopping_criteria: list
    default_max_length: bool  # max_length set nowhere: HF generates 20 new tokens
    prompt_lookup: PromptLookup | None = None
    logits_processor: tuple = ()  # the user's LogitsProcessors
    prefix_allowed_tokens_fn: object | None = None
    warping: bool = False  # see Plan.warping
    num_return_sequences: int = 1  # rows per prompt (sampling)
    default_min_length: bool = True  # min_length set nowhere (for HF's warnings)
    prefill_chunk_size: int | None = None  # see Plan.prefill_chunk_size
    lookbehind: Lookbehind = Lookbehind()  # HF's assistant_lookbehind / target_lookbehind (a draft with another tokenizer)

    def plan(self, model, prompt_length: int) -> Plan:
        """The ``Plan`` for a (decoder) prompt of ``prompt_length`` tokens: how many new tokens, at least and most."""
        config = self.config
        max_new = _max_new_tokens(model, config, prompt_length, self.default_max_length)
        _length_warnings(config, prompt_length, max_new, self.default_max_length, self.default_min_length)
        if config.min_new_tokens is not None:  # HF: min_new_tokens takes precedence, min_length is then overwritten
            min_new = _int_setting("min_new_tokens", config.min_new_tokens)  # (``_prepare_generated_length``)
        else:
            min_new = max(_int_setting("min_length", config.min_length) - prompt_length, 0)
        _check_builtin_criteria(self.stopping_criteria, self.eos_token_ids, prompt_length + int(max_new), config)
        if config.exponential_decay_length_penalty is not None and not self.eos_token_ids:
            raise ValueError(f"exponential_decay_length_penalty={config.exponential_decay_length_penalty!r} needs "
                             "eos_token_id (it raises the EOS logits); none is set")
        return Plan(
            sampling=self.sampling,
            num_speculative_tokens=self.num_speculative_tokens,
            max_new_tokens=int(max_new),
            min_new_tokens=int(min_new),
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=bool(config.return_dict_in_generate),
            # collected only where the output carries them, as model.generate does (a [B, T, V] buffer each)
            output_scores=bool(config.return_dict_in_generate and config.output_scores),
            output_logits=bool(config.return_dict_in_generate and config.output_logits),
            streamer=self.streamer,
            stopping_criteria=self.stopping_criteria,
            cache_implementation=config.cache_implementation,
            generation_config=config,
            logits_processor=self.logits_processor,
            prefix_allowed_tokens_fn=self.prefix_allowed_tokens_fn,
            context_processing=bool(self.logits_processor) or self.prefix_allowed_tokens_fn is not None
            or bool(context_fields_set(config)) or config.watermarking_config is not None,
            renormalize_logits=bool(config.renormalize_logits),
            warping=self.warping,
            watermark=config.watermarking_config is not None,
            stop_strings=stop_strings(config.stop_strings),
            max_time=_replaced_max_time(config.max_time, self.stopping_criteria),
            # (a caller's MaxLengthCriteria replaces HF's, and with it the reminder: it reminds by its own fields)
            max_position_embeddings=None if any(type(c) is MaxLengthCriteria for c in self.stopping_criteria)
            else getattr(model.config, "max_position_embeddings", None),
            prefill_chunk_size=self.prefill_chunk_size,
        )


def resolve_settings(model, num_speculative_tokens, generation_config, kwargs: dict, draft_model=None,
                     drafter=None) -> Settings:
    """Validate every generation keyword once. kwargs: what ``generate`` received besides the models, the inputs and
    its own arguments; a keyword that is neither a generation setting nor handled is refused here (ValueError).
    num_speculative_tokens: an int, "auto", or None (then num_assistant_tokens, else 5). draft_model / drafter:
    the call's (a checkpoint's prompt_lookup_num_tokens yields to either)."""
    _check_generation_config(generation_config)
    streamer = kwargs.pop("streamer", None)
    criteria = _check_callables(streamer, kwargs.pop("stopping_criteria", None))
    logits_processor = _check_processors(kwargs.pop("logits_processor", None))
    prefix_allowed_tokens_fn = kwargs.pop("prefix_allowed_tokens_fn", None)
    if prefix_allowed_tokens_fn is not None and not callable(prefix_allowed_tokens_fn):
        raise TypeError(f"prefix_allowed_tokens_fn must be callable (batch_id, input_ids) -> list of token ids, got "
                        f"{type(prefix_allowed_tokens_fn).__name__}")
    for name, off in (("synced_gpus", (None, False)), ("negative_prompt_ids", (None,)),
                      ("negative_prompt_attention_mask", (None,))):
        if kwargs.get(name) not in off:  # (synced_gpus=False: a single process, HF's default)
            raise ValueError(f"{name} is not supported by speculative_kernels.generate")
        kwargs.pop(name, None)
    # HF's generate reads trust_remote_code only to load a custom_generate (refused below), and drops it otherwise
    if not isinstance(kwargs.pop("trust_remote_code", None), (bool, type(None))):
        raise TypeError("trust_remote_code must be a bool or None")
    # (build_loop takes past_key_values / cache, a DynamicCache of the prompt's first tokens: ``prompt_cache.py``;
    # reaching here, they came another way)
    for name in ("past_key_values", "cache", "cache_params"):  # transformers 5.24 names it cache (older: the others)
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} (a cache of the prompt's first tokens, as model.generate takes) is not "
                             "supported here (speculative_kernels.generate and SpeculativeDecoder.start take a "
                             "DynamicCache as past_key_values or cache; cache_params, a state-space model's, never): "
                             "pass the whole prompt without it (the output is the same, the prompt's prefill is not "
                             "skipped)")
    for name in ("max_new_tokens", "max_length"):  # before HF's own checks, which fail on odd types unclearly
        if kwargs.get(name) is not None:
            kwargs[name] = _length(name, _unwrap_scalar(kwargs[name]))
    for name in ("min_new_tokens", "min_length"):
        if kwargs.get(name) is not None:
            _int_setting(name, kwargs[name])
    for name in _TOKEN_ID_FIELDS:
        token_ids(name, kwargs.get(name))
    if isinstance(kwargs.get("pad_token_id"), (list, tuple)):  # (model.generate fails on it inside transformers)
        raise TypeError(f"pad_token_id must be one token id (an int), got {kwargs['pad_token_id']!r}")
    zero_new = kwargs.get("max_new_tokens") == 0  # HF refuses 0; here it means "return the prompt"
    if zero_new:
        kwargs["max_new_tokens"] = 1
    default_max_length = _set_nowhere("max_length", model, generation_config, kwargs)
    lookup_given = {name: kwargs.get(name, getattr(generation_config, name, None))
                    for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size")}
    gamma = _choose_gamma(
        num_speculative_tokens,
        given=[kwargs.get("num_assistant_tokens"), getattr(generation_config, "num_assistant_tokens", None)],
        defaults=[model.generation_config.num_assistant_tokens,
                  getattr(getattr(draft_model, "generation_config", None), "num_assistant_tokens", None)])
    _check_draft_schedule(draft_model, num_speculative_tokens)
    for source in (generation_config, kwargs):  # (HF's validate and processors fail on these unclearly)
        _check_typed_fields(source if isinstance(source, dict) else {} if source is None else vars(source))
    # The checkpoint's generation_config.json where the call does not set the field (transformers fills a passed
    # generation_config's unset fields from it too): first what transformers' own preparation fails on, then, on
    # the merged settings, the rest (the warpers' fields only when sampling, as HF reads them)
    given = vars(generation_config) if generation_config is not None else {}
    own = {name: value for name, value in vars(model.generation_config).items()
           if name not in kwargs and given.get(name) is None}
    _checkpoint_fields(own, sampling=False)
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    _checkpoint_fields({name: getattr(config, name, None) for name in own}, sampling=bool(config.do_sample))
    if config.cache_implementation in STATIC_ALIASES:  # what model.generate builds for them: its static cache
        HF_LOGGER.warning_once(  # (its text, transformers 5.17 to 5.24)
            f"Using `cache_implementation='{config.cache_implementation}' is deprecated and will be removed in v5.13. "
            "Please only use one of ('static', 'offloaded_static'), and the layer structure will be inferred "
            "automatically.")
        config.cache_implementation = "static"
    if zero_new:
        config.max_new_tokens = 0
    schedule_in_call = (kwargs.get("num_assistant_tokens_schedule") is not None
                        or getattr(generation_config, "num_assistant_tokens_schedule", None) is not None)
    _check_refused(config, check_schedule=schedule_in_call or (num_speculative_tokens is None
                                                               and not config.prompt_lookup_num_tokens),
                   from_model=frozenset(own))
    model_kwargs.pop("use_cache", None)
    # None is "not given" to HF's generate (its unused-keyword check skips None values: inputs_embeds=None,
    # past_key_values=None as a continue-generation recipe passes our output's)
    model_kwargs = {name: value for name, value in model_kwargs.items() if value is not None}
    if model_kwargs:
        hints = [_MODEL_INPUT_HINTS[name] for name in sorted(model_kwargs) if name in _MODEL_INPUT_HINTS]
        hint = "".join(f"; {h}" for h in dict.fromkeys(hints))
        raise ValueError(f"unsupported keyword arguments for speculative_kernels.generate: {sorted(model_kwargs)}"
                         f"{hint}")

    warping = False
    if config.do_sample:
        # (temperature=None: HF applies no temperature warper, i.e. 1.0; top_k=None: no top-k)
        temperature = 1.0 if config.temperature is None else config.temperature
        if temperature != 1.0 and not isinstance(temperature, float):  # as HF's TemperatureLogitsWarper refuses it
            raise ValueError(f"temperature must be a float when do_sample=True (as in model.generate), got "
                             f"{type(temperature).__name__} {temperature!r}")
        sampling = Sampling(*check_sampling_params(temperature, config.top_k or 0, config.top_p))
        if sampling.temperature == 0.0:
            raise ValueError("do_sample=True needs temperature > 0 (use do_sample=False for greedy decoding)")
        warping = bool(warper_fields_set(config)) or config.watermarking_config is not None
        if warping:  # HF's chain (its temperature, top-k and top-p included) runs before the verification
            sampling = Sampling(1.0, 0, 1.0)
    else:
        sampling = GREEDY
    for name in _TOKEN_ID_FIELDS:  # (the call's were checked above: these come from a generation_config)
        try:
            token_ids(name, getattr(config, name))
        except (TypeError, ValueError) as error:
            raise type(error)(f"{error} (from the model's or the passed generation_config: pass {name}= in the call "
                              "to override it)") from None
    eos = token_ids("eos_token_id", config.eos_token_id)
    pad_ids = token_ids("pad_token_id", config.pad_token_id)
    if len(pad_ids) > 1:
        raise TypeError(f"pad_token_id must be one token id, got {config.pad_token_id!r}")
    pad = pad_ids[0] if pad_ids else (eos[0] if eos else None)
    for name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size"):  # HF skips a negative size silently
        _int_setting(name, getattr(config, name, None))
    lookup = _prompt_lookup(config, lookup_given, draft_model is not None or drafter is not None)
    if lookup is not None:
        gamma, lookup = _lookup_gamma(num_speculative_tokens, gamma, lookup,
                                      lookup_given["prompt_lookup_num_tokens"] is not None)
    copies = config.num_return_sequences
    if copies is not None and (isinstance(copies, bool) or not isinstance(copies, numbers.Integral) or copies < 1):
        raise ValueError(f"num_return_sequences must be an int >= 1, got {copies!r}")
    copies = int(copies or 1)
    if copies > 1 and not config.do_sample:  # (HF's own check says the same, where it runs first)
        raise ValueError(f"num_return_sequences={copies} needs do_sample=True: greedy decoding gives one sequence")
    chunk = prefill_chunk_size(config.prefill_chunk_size, from_model="prefill_chunk_size" in own)
    return Settings(config, sampling, gamma, eos, pad, streamer, criteria, default_max_length, lookup,
                    logits_processor, prefix_allowed_tokens_fn, warping, copies,
                    _set_nowhere("min_length", model, generation_config, kwargs), chunk, _lookbehind(config))


def _lookbehind(config) -> Lookbehind:
    """HF's lookbehind windows, checked (ints >= 0; None is HF's default, 10)."""
    values, given = {}, []
    defaults = _hf_defaults()
    for name in ("assistant_lookbehind", "target_lookbehind"):
        value = _scalar(getattr(config, name, None))
        if value is None:
            value = defaults.get(name, 10)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (HF's default 10), got {value!r}")
        if value != defaults.get(name, 10):
            given.append(name)
        values[name] = int(value)
    return Lookbehind(values["assistant_lookbehind"], values["target_lookbehind"], tuple(given))


def prefill_chunk_size(value, from_model: bool = False) -> int | None:
    """HF's ``prefill_chunk_size``: None, or an int >= 1 (a NumPy or 0-d tensor integer too). HF's validate checks
    nothing and ``torch.split`` fails on the rest inside its prefill (0, -1: RuntimeError; True, 2.5, "3":
    TypeError); here they are refused by name before anything runs. from_model: the value is the model's
    generation_config's (the message says so)."""
    if value is None:
        return None
    source = " (from the model's generation_config)" if from_model else ""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"prefill_chunk_size must be an int >= 1 or None, got {type(value).__name__} "
                        f"{value!r}{source}")
    if value < 1:
        raise ValueError(f"prefill_chunk_size must be an int >= 1 or None, got {value!r}{source}")
    return int(value)


def _max_time(value) -> float | None:
    if value is None:
        return None
    # 0, as in HF: stop after the first iteration
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0 or not math.isfinite(value):
        raise ValueError(f"max_time must be a number of seconds >= 0, got {value!r}")
    return float(value)


_SAMPLING_ONLY = ("typical_p", "epsilon_cutoff", "eta_cutoff", "min_p", "top_h")  # HF's warpers: read when sampling


def _check_typed_fields(fields: dict, ids: bool = True, sampling: bool = True) -> None:
    """TypeError/ValueError naming a setting of ``fields`` (a call's keywords, or a GenerationConfig's attributes)
    whose type model.generate's own checks and processors fail on inside transformers (None: unset). ids: also
    check the token ids' range (a call's own; a checkpoint's negative ids HF runs with); sampling: also the warpers'
    fields, which HF reads only when sampling."""
    copies = fields.get("num_return_sequences")
    if copies is not None and (isinstance(copies, bool) or not isinstance(copies, numbers.Integral) or copies < 1):
        raise ValueError(f"num_return_sequences must be an int >= 1, got {copies!r}")
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        value = fields.get(name)
        if value is not None and (isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__")
                                  or getattr(value, "ndim", 1) != 1):
            raise TypeError(f"{name} must be a list of token ids, got {type(value).__name__} {value!r}")
        if value is not None and ids:
            token_ids(name, [_scalar(v) for v in value])
    decay = fields.get("exponential_decay_length_penalty")
    if decay is not None and not (isinstance(decay, (list, tuple)) and len(decay) == 2
                                  and all(_is_number(v) for v in decay)):
        raise TypeError("exponential_decay_length_penalty must be a pair (start_index, decay_factor), got "
                        f"{decay!r}")
    for name in (*(_SAMPLING_ONLY if sampling else ()), "repetition_penalty", "encoder_repetition_penalty"):
        value = fields.get(name)
        if value is not None and not _is_number(value):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")


def _checkpoint_fields(fields: dict, sampling: bool) -> None:
    """``_check_typed_fields`` of a checkpoint's generation_config values, naming where they come from."""
    try:
        _check_typed_fields(fields, ids=False, sampling=sampling)
    except (TypeError, ValueError) as error:
        raise type(error)(f"the model's generation_config (its generation_config.json): {error}") from error


def _scalar(value):
    """A 0-d tensor or array element as its Python number (what HF's processors read from it); anything else as is."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", None) == 0 else value


def _is_number(value) -> bool:
    """A real number other than a bool: a Python or NumPy number, or a 0-d tensor or array of one (HF takes those)."""
    value = _scalar(value)
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _replaced_max_time(value, criteria) -> float | None:
    """``max_time`` (validated), or None where the caller's stopping criteria hold a ``MaxTimeCriteria``: HF's
    ``_merge_criteria_processor_list`` uses that one in place of the criterion max_time builds."""
    from transformers.generation.stopping_criteria import MaxTimeCriteria

    seconds = _max_time(value)
    return None if any(type(criterion) is MaxTimeCriteria for criterion in criteria) else seconds


def stop_strings(value) -> tuple:
    """HF's ``stop_strings``: a non-empty string or a list of them (None: none) -> a tuple of strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(x, str) and x for x in items):
        raise TypeError(f"stop_strings must be a non-empty string or a list of non-empty strings, got {value!r}")
    return tuple(items)


def warper_fields_set(config) -> list[str]:
    """The fields of ``WARPERS`` that ``config`` sets (to anything but off or HF's default)."""
    defaults = _hf_defaults()
    return [name for name, off in WARPERS.items()
            if not _is_off(getattr(config, name, None), off, defaults.get(name))]


def context_fields_set(config) -> list[str]:
    """The fields of ``CONTEXT_PROCESSED`` that ``config`` sets (to anything but off or HF's default)."""
    defaults = _hf_defaults()
    return [name for name, off in CONTEXT_PROCESSED.items()
            if not _is_off(getattr(config, name, None), off, defaults.get(name))]


def _check_processors(logits_processor) -> tuple:
    """generate's ``logits_processor``: None or a list (a ``LogitsProcessorList``) of callables
    (input_ids [B, L], scores [B, V]) -> scores."""
    return _callables("logits_processor", logits_processor, "a LogitsProcessorList", "scores")


def _prompt_lookup(config, given: dict, drafting: bool) -> PromptLookup | None:
    """HF's prompt-lookup settings, checked; None when prompt_lookup_num_tokens is not set, or set only by the
    model's generation_config while the call drafts otherwise. given: the two settings as the call passed them
    (keyword or generation_config=), None where not; drafting: the call passed draft_model or drafter."""
    num_tokens, max_ngram = config.prompt_lookup_num_tokens, config.max_matching_ngram_size
    if drafting and given["prompt_lookup_num_tokens"] is None:
        # A checkpoint's prompt_lookup_num_tokens is a default, and the call's draft model or drafter wins (HF's
        # generate would use prompt lookup and ignore the assistant); max_matching_ngram_size is prompt lookup's
        # alone: passed with another drafter it would do nothing
        if given["max_matching_ngram_size"] is not None:
            raise ValueError("max_matching_ngram_size applies to prompt lookup (prompt_lookup_num_tokens=) only; "
                             "with draft_model or drafter= it would change nothing")
        return None
    if num_tokens is None:  # max_matching_ngram_size alone changes nothing, as in HF
        return None
    if drafting:
        raise ValueError("pass either draft_model (or assistant_model) / drafter= or prompt_lookup_num_tokens, not "
                         "both: prompt lookup drafts without a model")
    for name, value in (("prompt_lookup_num_tokens", num_tokens), ("max_matching_ngram_size", max_ngram)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return PromptLookup(int(num_tokens), int(max_ngram or DEFAULT_MAX_MATCHING_NGRAM_SIZE))


def check_lookup_gamma(num_speculative_tokens, prompt_lookup_num_tokens) -> None:
    """ValueError where a gamma given beside prompt lookup cannot apply ("auto", or an int other than
    prompt_lookup_num_tokens), as ``generate`` refuses them: ``SpeculativeDecoder`` checks its pair once, rather than
    at every request's first step."""
    if num_speculative_tokens is not None and prompt_lookup_num_tokens is not None:
        _lookup_gamma(num_speculative_tokens, num_speculative_tokens,
                      PromptLookup(prompt_lookup_num_tokens, DEFAULT_MAX_MATCHING_NGRAM_SIZE), given=True)


def _lookup_gamma(num_speculative_tokens, gamma, lookup: PromptLookup, given: bool) -> tuple[int, PromptLookup]:
    """Prompt lookup's gamma and settings: prompt_lookup_num_tokens. num_speculative_tokens, if given, must agree
    with the call's; a checkpoint's (``given`` False) yields to it, as a checkpoint's num_assistant_tokens does."""
    if num_speculative_tokens is not None and gamma != lookup.num_tokens:
        if not given and isinstance(gamma, int):
            return gamma, PromptLookup(gamma, lookup.max_ngram)
        if gamma == "auto":
            source = "" if given else " (from the model's generation_config)"
            raise ValueError(f"num_speculative_tokens='auto' is not available with prompt lookup "
                             f"(prompt_lookup_num_tokens={lookup.num_tokens}{source}): pass an int, or leave "
                             "num_speculative_tokens unset to propose up to prompt_lookup_num_tokens tokens")
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} and prompt_lookup_num_tokens="
                         f"{lookup.num_tokens} disagree; pass prompt_lookup_num_tokens only")
    return lookup.num_tokens, lookup
