"""The one place that turns a call into a ready ``SpeculativeLoop``, for ``generate`` and ``SpeculativeDecoder``:
inputs and settings validated once, the architectures checked, the runners sized (memory checked), built and, with
``compile=True``, captured and warmed up."""

import dataclasses
import functools

import torch

from ..ops import backends
from ..ops.randomness import check_seed
from .buffers import initial_slots
from .capabilities import check_request, request_path
from .drafter import ModelDrafter
from .inputs import check_batch, check_helpers, check_models, check_token_type, prepare_prompt, prompt_length
from .loop import SpeculativeLoop
from .options import BatchingOptions, CompileOptions
from .runners import capture_steps, make_runner, plan_runners
from .seq2seq_inputs import prepare_seq2seq
from .settings import Plan, resolve_settings
from .vocab import VocabBridge

SEQ2SEQ_KEYWORDS = ("decoder_input_ids", "decoder_attention_mask", "encoder_outputs")


def build_loop(model, draft_model, input_ids: torch.Tensor | None = None, *, num_speculative_tokens=None,
               tokenizer=None, assistant_tokenizer=None, generation_config=None, backend: str = "auto",
               batching: BatchingOptions | None = None, compile_options: CompileOptions | None = None,
               seed: int | None = None, **kwargs) -> SpeculativeLoop:
    """Validate a call of ``generate`` (same arguments; ``compile_options`` for ``compile``) and build its loop,
    prefilled.

    input_ids: [B, L] (decoder-only: the prompts, left-padded with ``attention_mask``; encoder-decoder: the encoder
    input). Everything is checked before anything is allocated; the encoders run once the checks have passed.
    """
    check_helpers(tokenizer, assistant_tokenizer, batching)
    seed = check_seed(seed)
    check_models(model, draft_model)
    attention_mask = kwargs.pop("attention_mask", None)
    if "inputs" in kwargs:
        if input_ids is not None:
            raise ValueError("pass either input_ids or inputs, not both")
        input_ids = kwargs.pop("inputs")
    check_token_type("input_ids", input_ids)
    encoder_decoder = model.config.is_encoder_decoder
    seq2seq_inputs = {name: kwargs.pop(name, None) for name in SEQ2SEQ_KEYWORDS} if encoder_decoder else {}
    settings = resolve_settings(model, num_speculative_tokens, generation_config, kwargs, draft_model)
    if encoder_decoder:  # the loop's prompt is the decoder's
        prompt = prepare_seq2seq(model, draft_model, input_ids, attention_mask, settings.config, **seq2seq_inputs)
        plan = settings.plan(model, prompt.decoder_ids.shape[1])
        input_ids, attention_mask = prompt.decoder_ids, prompt.decoder_mask
    else:
        plan = settings.plan(model, prompt_length(input_ids))
        input_ids, attention_mask = prepare_prompt(model, input_ids, attention_mask, settings.config.bos_token_id)
    batch, width = input_ids.shape
    device = input_ids.device
    static = wants_static(plan, compile_options)
    specs = check_request(model, draft_model, path=request_path(static, compile_options is not None), batch=batch)
    batching = batching or BatchingOptions()
    runner_plan = plan_runners(model, draft_model, specs, static=static, batch=batch, prompt_width=width,
                               max_new_tokens=plan.max_new_tokens, gamma=plan.max_gamma,
                               slots=initial_slots(width, plan.max_gamma, plan.max_new_tokens), batching=batching,
                               device=device)
    check_batch(plan, batch)
    bridge = VocabBridge(model, draft_model, tokenizer, assistant_tokenizer)
    impl = backends.implementation(backend, device.type)
    encoded = prompt.encode() if encoder_decoder else {}
    encoder_mask = prompt.encoder_mask if encoder_decoder else None
    target_runner, draft_runner = (make_runner(m, spec, runner_plan, encoded.get(id(m)), encoder_mask)
                                   for m, spec in zip((model, draft_model), specs))
    dtype = next(model.parameters()).dtype  # verification runs in the target's dtype
    drafter = ModelDrafter(draft_runner, bridge, dtype)
    warm_up = None
    if compile_options is not None:  # captured after the prefill; fixed shapes, so no row leaves the batch
        steps = [(target_runner, [(plan.num_speculative_tokens + 1, False)]),
                 (draft_runner, ModelDrafter.CAPTURED_SHAPES)]
        warm_up = functools.partial(capture_steps, steps, compile_options, device)
        batching = dataclasses.replace(batching, drop_finished_fraction=None)
    return SpeculativeLoop(target_runner, drafter, plan, input_ids, attention_mask, vocab=bridge.target_width,
                           dtype=dtype, impl=impl, batching=batching, warm_up=warm_up, seed=seed)


def wants_static(plan: Plan, compile_options: CompileOptions | None) -> bool:
    """Whether the request runs on the static cache: ``cache_implementation="static"`` or compiling (captured steps
    need the static cache's fixed shapes). Raises ValueError for combinations that cannot work."""
    if compile_options is not None and plan.cache_implementation == "dynamic":
        raise ValueError("compile=True captures fixed shapes and needs the static cache; "
                         "do not combine it with cache_implementation='dynamic'")
    if plan.cache_implementation != "static" and compile_options is None:
        return False
    if not isinstance(plan.num_speculative_tokens, int):  # "auto": gamma changes while decoding
        raise ValueError(f"cache_implementation='static' and compile=True need a fixed num_speculative_tokens (the "
                         f"cache is sized and the steps are captured for it), got {plan.num_speculative_tokens!r}")
    return True
