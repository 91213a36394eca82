"""``speculative_kernels.generate``: a drop-in for ``model.generate`` that speculates with a draft model."""

import dataclasses

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .capabilities import check_request, request_path
from .loop import SpeculativeLoop
from .runner import DecoderRunner
from .seq2seq import SpeculativeEncoderDecoderOutput, check_pair, prepare_seq2seq
from .compaction import BatchingOptions
from .settings import resolve_plan
from .seq2seq_static import static_seq2seq_factory
from .static_runner import choose_runner_factory, compile_loop, compile_options_from, wants_static
from .stats import SpeculationStats
from .vocab import VocabBridge, check_ids_in_vocabulary


@dataclasses.dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``speculation_stats``. ``past_key_values`` is None: the caches hold
    rolled-back holes and are not meant for reuse."""

    speculation_stats: SpeculationStats | None = None


def _model_device(model, name: str) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        raise ValueError(f"{name} has no parameters") from None


def _check_models(model, draft_model) -> None:
    if draft_model is None:
        raise ValueError("draft_model (or assistant_model) is required")
    for name, m in (("model", model), ("draft_model", draft_model)):
        if not hasattr(m, "generation_config") or not callable(getattr(m, "forward", None)):
            raise TypeError(f"{name} must be a Hugging Face PreTrainedModel, got {type(m).__name__}")
    if model.config.is_encoder_decoder or draft_model.config.is_encoder_decoder:
        check_pair(model, draft_model)  # both encoder-decoder, of a supported architecture
    target_device, draft_device = _model_device(model, "model"), _model_device(draft_model, "draft_model")
    if target_device != draft_device:
        raise ValueError(f"model is on {target_device} but draft_model is on {draft_device}; put both on one device")


def _check_mask(name: str, mask, shape) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of 0/1 values, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but input_ids has {tuple(shape)}")
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{name} must be an integer or bool tensor, got {mask.dtype}")
    return mask


def _prepare_inputs(model, input_ids, attention_mask, plan_bos):
    device = _model_device(model, "model")
    if input_ids is not None and not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [batch, length], got "
                        f"{type(input_ids).__name__}")
    if input_ids is None or input_ids.numel() == 0:
        if plan_bos is None:
            raise ValueError("input_ids is empty and the model has no bos_token_id to start from")
        batch = 1 if input_ids is None or input_ids.dim() < 2 else max(input_ids.shape[0], 1)
        input_ids = torch.full((batch, 1), int(plan_bos), dtype=torch.int64, device=device)
        attention_mask = None
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, length] tensor, got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    input_ids = input_ids.to(device=device, dtype=torch.int64)
    check_ids_in_vocabulary(model, "input_ids", input_ids)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = _check_mask("attention_mask", attention_mask, input_ids.shape).to(device)
    real = attention_mask != 0
    empty = (~real.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask is all zeros in batch rows {empty}: every prompt needs at least one real "
                         "token (pass the row's BOS token to start from nothing)")
    if not bool(real[:, -1].all()):
        raise ValueError("attention_mask shows right padding; decoder-only generation needs left padding")
    return input_ids, attention_mask


def _check_helpers(tokenizer, assistant_tokenizer, batching) -> None:
    for name, value in (("tokenizer", tokenizer), ("assistant_tokenizer", assistant_tokenizer)):
        if value is not None and not callable(getattr(value, "get_vocab", None)):
            raise TypeError(f"{name} must be a transformers tokenizer (with get_vocab()), got {type(value).__name__}")
    if batching is not None and not isinstance(batching, BatchingOptions):
        raise TypeError(f"batching must be a speculative_kernels BatchingOptions, got {type(batching).__name__}")


def build_loop(model, draft_model, input_ids, *, num_speculative_tokens=None, tokenizer=None,
               assistant_tokenizer=None, generation_config=None, backend: str = "auto",
               batching: BatchingOptions | None = None, compile_options=None, **kwargs):
    """Validate everything and build the ``SpeculativeLoop`` for one batch of prompts (shared by ``generate`` and
    ``SpeculativeDecoder``). Returns (loop, plan, input_ids)."""
    _check_helpers(tokenizer, assistant_tokenizer, batching)
    batching = batching or BatchingOptions()
    _check_models(model, draft_model)
    attention_mask = kwargs.pop("attention_mask", None)
    if "inputs" in kwargs:
        if input_ids is not None:
            raise ValueError("pass either input_ids or inputs, not both")
        input_ids = kwargs.pop("inputs")
    if model.config.is_encoder_decoder:  # input_ids becomes the decoder prompt (seq2seq.py)
        plan, input_ids, attention_mask, runner_factory = prepare_seq2seq(
            model, draft_model, input_ids, attention_mask, num_speculative_tokens, generation_config, kwargs)
        static = wants_static(plan, compile_options)
        check_request(model, draft_model, path=request_path(static, compile_options is not None),
                      batch=input_ids.shape[0])
        if static:
            runner_factory = static_seq2seq_factory(
                model, draft_model, runner_factory, batch=input_ids.shape[0], prompt_width=input_ids.shape[1],
                max_new_tokens=plan.max_new_tokens, gamma=plan.num_speculative_tokens, device=input_ids.device)
    else:
        if input_ids is not None and not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids [batch, length], got "
                            f"{type(input_ids).__name__}")
        prompt_length = 0 if input_ids is None or input_ids.dim() < 2 else input_ids.shape[1]
        plan, model_kwargs = resolve_plan(model, max(prompt_length, 1), num_speculative_tokens, generation_config,
                                          kwargs, draft_model)
        model_kwargs.pop("use_cache", None)
        if model_kwargs:
            raise ValueError(f"unsupported keyword arguments for speculative_kernels.generate: {sorted(model_kwargs)}")
        input_ids, attention_mask = _prepare_inputs(model, input_ids, attention_mask,
                                                    plan.generation_config.bos_token_id)
        check_request(model, draft_model, path=request_path(wants_static(plan, compile_options), compile_options is not None),
                      batch=input_ids.shape[0])
        runner_factory = choose_runner_factory(model, draft_model, plan, input_ids, batching, compile_options)
    batch = input_ids.shape[0]
    if batch > 1 and plan.streamer is not None:
        raise ValueError("streamer supports batch size 1 only (as in transformers)")
    if batch > 1 and plan.stopping_criteria:
        raise ValueError("stopping_criteria are supported for batch size 1 only")
    if batch > 1 and plan.pad_token_id is None:
        raise ValueError("batch > 1 needs pad_token_id (or eos_token_id) to pad finished rows")
    bridge = VocabBridge(model, draft_model, tokenizer, assistant_tokenizer)
    loop = SpeculativeLoop(model, draft_model, bridge, plan, input_ids, attention_mask, backend=backend,
                           runner_factory=runner_factory)
    return loop, plan, input_ids


def generate(
    model,
    input_ids: torch.Tensor | None = None,
    *,
    draft_model=None,
    num_speculative_tokens: int | str | None = None,
    assistant_model=None,
    tokenizer=None,
    assistant_tokenizer=None,
    generation_config=None,
    speculation_stats: SpeculationStats | None = None,
    backend: str = "auto",
    compile=False,
    batching: BatchingOptions | None = None,
    **kwargs,
):
    """Speculative decoding with ``model.generate``'s arguments and return values.

    input_ids: [B, L] (left-padded with ``attention_mask`` for B > 1). Returns a LongTensor [B, L + new] of prompt
    plus new tokens, or a ``SpeculativeDecoderOnlyOutput`` (a ``GenerateDecoderOnlyOutput``) with
    ``return_dict_in_generate=True``, whose ``speculation_stats`` holds the statistics. With a tensor result, pass
    ``speculation_stats=SpeculationStats()`` to have it filled in. ``assistant_model`` is another name for
    ``draft_model``; ``tokenizer``/``assistant_tokenizer`` let a padded draft vocabulary be checked and used.

    Encoder-decoder pairs (T5/MT5, BART/mBART; ``seq2seq.py``): input_ids/attention_mask are the encoder input
    (right-padded as usual); the decoder starts from ``decoder_start_token_id`` or from ``decoder_input_ids`` (with
    ``decoder_attention_mask``), and ``encoder_outputs`` may replace the target's encoder pass, as in HF. The result
    holds the decoder sequences; with ``return_dict_in_generate=True`` it is a ``SpeculativeEncoderDecoderOutput``.

    ``num_speculative_tokens`` (gamma) is the number of draft tokens per iteration, or ``"auto"``: start at 4,
    measure the acceptance rate alpha and the cost ratio c over the first iterations and continue with the gamma in
    1..16 that maximises the paper's expected speedup (``gamma.py``; the choice is in
    ``speculation_stats.num_speculative_tokens``). Not given: HF's ``num_assistant_tokens`` where it is set (the
    call, ``generation_config``, the target's or the draft's generation_config), else 5. An iteration never drafts
    more tokens than are left to generate (none when one is left).

    ``cache_implementation="static"`` preallocates both KV caches (``static_runner.py``; for encoder-decoder pairs the
    decoders' self-attention caches, ``seq2seq_static.py``). ``compile=True`` (or a
    ``CompileOptions``) also captures the draft and verification steps with ``torch.compile`` (CUDA graphs on CUDA);
    its warm-up is reported in ``speculation_stats.warmup_time_s``, apart from ``total_time_s``. ``batching`` (a
    ``BatchingOptions``) tunes hole compaction and the dropping of finished rows (``docs/batching.md``).
    """
    if assistant_model is not None:
        if draft_model is not None and draft_model is not assistant_model:
            raise ValueError("pass either draft_model or assistant_model, not both")
        draft_model = assistant_model
    if speculation_stats is not None and not isinstance(speculation_stats, SpeculationStats):
        raise TypeError(f"speculation_stats must be a SpeculationStats, got {type(speculation_stats).__name__}")
    compile_options = compile_options_from(compile)
    with torch.inference_mode():
        loop, plan, input_ids = build_loop(
            model, draft_model, input_ids, num_speculative_tokens=num_speculative_tokens, tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer, generation_config=generation_config, backend=backend,
            batching=batching, compile_options=compile_options, **kwargs
        )
        if compile_options is not None:
            loop.stats.warmup_time_s = compile_loop(loop, compile_options)
            batching = dataclasses.replace(batching or BatchingOptions(), drop_finished_fraction=None)  # fixed shapes
        loop.batching = batching or loop.batching
        sequences, stats = loop.run()
    if speculation_stats is not None:
        for field in dataclasses.fields(SpeculationStats):
            setattr(speculation_stats, field.name, getattr(stats, field.name))
    if not plan.return_dict_in_generate:
        return sequences
    scores, logits = loop.collected_scores(sequences.shape[1] - input_ids.shape[1])
    if model.config.is_encoder_decoder:
        return SpeculativeEncoderDecoderOutput(sequences=sequences, scores=scores, logits=logits,
                                               speculation_stats=stats)
    return SpeculativeDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, speculation_stats=stats)
