"""The one place that sizes and builds the runners of a request: the dynamic or the static cache, for decoder-only or
encoder-decoder models."""

import dataclasses

import torch

from ..capabilities import ModelSpec, slot_table_limit
from ..memory import check_free_memory
from ..options import BatchingOptions, StaticRows
from ..wrapped_seq2seq import is_wrapper
from .decoder import DecoderRunner
from .dynamic_cache import CachedPrefix
from .protocol import Runner
from .recurrent import RecurrentRunner
from .seq2seq import Seq2SeqRunner
from .sizing import captured_capacity, static_capacity, static_memory_bytes
from .slot_cache import CacheLayout
from .static_decoder import StaticDecoderRunner
from .static_seq2seq import StaticSeq2SeqRunner


@dataclasses.dataclass(frozen=True)
class RunnerPlan:
    """How the two runners of a request are built (``plan_runners``).

    static: preallocated caches; batch: B; slots: the slot masks' initial width (they grow); capacity: slots per row
    of a static cache (0 on the dynamic cache); reserve: the most slots one iteration writes (gamma + 1); rows: rows
    allocated by a decoder-only static cache whose rows join and leave in place (``StaticRows``; None: B, fixed).
    """

    static: bool
    batch: int
    slots: int
    capacity: int
    reserve: int
    batching: BatchingOptions
    device: torch.device
    rows: int | None = None


def check_slot_tables(models, names, capacity: int, sized: str, lower: str) -> None:
    """ValueError when a model slices a table sized by its position limit with the cache's slot count
    (``capabilities.slot_table_limit``: GPT-Neo, MPT) and a static cache of ``capacity`` slots (``sized``: how they
    add up) would pass it; the remedy names ``lower``."""
    for model, name in zip(models, names):
        limit = None if model is None else slot_table_limit(model)
        if limit is not None and capacity > limit:
            raise ValueError(f"{name} ({type(model).__name__}) slices a table of {limit} key positions with the "
                             f"cache's slot count, and the static cache here holds {capacity} slots ({sized}): lower "
                             f"{lower}, or use the dynamic cache (model.generate's caches hold no more slots than "
                             "positions)")


def plan_runners(models: tuple, specs: tuple[ModelSpec, ...], *, static: bool, batch: int, prompt_width: int,
                 max_new_tokens: int, gamma: int, slots: int, batching: BatchingOptions,
                 device: torch.device, static_rows: StaticRows | None = None, captured: bool = False,
                 sources: tuple[tuple[int, int], ...] = (), prefill_chunk_size: int | None = None) -> RunnerPlan:
    """Size the runners. On the static caches, raise MemoryError before anything is allocated when the device cannot
    hold them (``docs/batching.md``: the bound). models: (target, draft) or (target,) for a drafter without a model,
    specs their ``ModelSpec``; gamma: the fixed draft length (static); slots: the dynamic slot masks' initial
    width; static_rows: allocate the static caches for that many rows of that context (rows joining in place);
    captured: the steps will be compiled (the capacity is bucketed, ``sizing.captured_capacity``, so that calls of
    other lengths reuse the compiled steps); sources: an encoder-decoder's (S, H) per model, its encoder output's
    length and width (each decoder's cross-attention K/V, B x S per layer, and the output [B, S, H] are counted
    too; () where unknown); prefill_chunk_size: the most tokens of one prefill
    forward (HF's; None: the whole prompt), which bounds the prefill's transient masks."""
    if not static:  # (reserve: kept free below a model's slot table, ``DecoderRunner``)
        return RunnerPlan(False, batch, slots, 0, gamma + 1, batching, device)
    encoder_decoder = specs[0].encoder_decoder
    rows, prefill_width = batch, prompt_width if prefill_chunk_size is None else min(prompt_width, prefill_chunk_size)
    if static_rows is not None:
        # (each row's prompt plus max_new_tokens is at most max_context: the caller's check, per row)
        if encoder_decoder or static_rows.rows < batch or prompt_width > static_rows.max_context:
            raise ValueError(f"static_rows={static_rows} cannot hold this batch of {batch} decoder-only rows of "
                             f"prompts {prompt_width} wide")
        rows, prompt_width, max_new_tokens = static_rows.rows, static_rows.max_context, 0
    # Encoder-decoder rows stay hole-free (no compaction, no slack): the longest row plus one iteration.
    capacity = static_capacity(prompt_width, max_new_tokens, gamma, 1 if encoder_decoder else rows, batching.slack)
    if captured and static_rows is None:  # (continuous batching: sized once per decoder, by max_context)
        capacity = captured_capacity(capacity)
    sized = ("max_context plus one iteration's slots and the batch's slack" if static_rows is not None else
             "prompt + max_new_tokens + 2 * (gamma + 1) + 2" + (", plus the batch's slack" if rows > 1 else "")
             + (", rounded up for compile=True" if captured else ""))
    check_slot_tables(models, ("model", "draft_model"), capacity, sized,
                      "max_context" if static_rows is not None else "max_new_tokens")
    layouts = [CacheLayout.of(model, spec) for model, spec in zip(models, specs)]
    required = static_memory_bytes(layouts, list(specs), rows, capacity, queries=max(gamma + 1, prefill_width))
    if encoder_decoder and sources:  # each decoder's cross-attention K/V over its source (filled once), and each
        # encoder's output [B, S, H]; captured steps pad the source to a bucket
        widths = [captured_capacity(width) if captured and width else width for width, _ in sources]
        cross = sum(layout.bytes(rows, width) for layout, width in zip(layouts, widths))
        encoded = sum(rows * width * hidden * torch.empty((), dtype=layout.dtype).element_size()
                      for (_, hidden), width, layout in zip(sources, widths, layouts))
        required = {**required, "cross_attention_kv": cross, "encoder_outputs": encoded,
                    "total": required["total"] + cross + encoded}
    what = "the static decoder caches" if encoder_decoder else "the static caches"
    whose = "target and draft" if len(models) > 1 else "target"
    remedy = ("lower the decoder's max_batch_size or max_context" if static_rows is not None
              else "lower the batch size or max_new_tokens")
    check_free_memory(required, device, f"{what} ({rows} rows x {capacity} slots, {whose})", remedy)
    return RunnerPlan(True, batch, slots, capacity, gamma + 1, batching, device,
                      rows if static_rows is not None else None)


def encoder_hidden_size(model) -> int:
    """The width H of a text encoder's output [B, S, H], from its config (a generic wrapper's: its encoder's; its own
    config has no width)."""
    config = model.config.encoder if is_wrapper(model) else model.config.get_text_config(decoder=False)
    return int(getattr(config, "d_model", None) or getattr(config, "hidden_size", 0) or 0)


def make_runner(model, spec: ModelSpec, plan: RunnerPlan, encoder_outputs=None, encoder_mask=None,
                prefix: CachedPrefix | None = None) -> Runner:
    """The runner of one model. Encoder-decoder models take their encoder output [B, S, H] and mask [B, S]. prefix:
    the prompt's first tokens cached by the caller, which only the dynamic decoder-only runner starts from
    (``prompt_cache.check_prompt_path`` refuses the others first)."""
    if spec.recurrent:  # (batch 1 on the dynamic cache: ``capabilities._recurrent_spec``; a prompt cache is refused
        return RecurrentRunner(model, spec, plan.device, plan.reserve)  # by ``request.build_loop``)
    if prefix is not None and (spec.encoder_decoder or plan.static):
        raise ValueError("a cache of the prompt's first tokens runs on the dynamic cache of a decoder-only model only")
    if spec.encoder_decoder:
        if plan.static:
            return StaticSeq2SeqRunner(model, spec, plan.batch, plan.slots, plan.device, encoder_outputs, encoder_mask,
                                       capacity=plan.capacity)
        return Seq2SeqRunner(model, spec, plan.batch, plan.slots, plan.device, encoder_outputs, encoder_mask)
    compaction = dict(compaction_threshold=plan.batching.compaction_threshold,
                      compaction_backend=plan.batching.compaction_backend)
    if plan.static:
        return StaticDecoderRunner(model, spec, plan.batch, plan.capacity, plan.device, reserve=plan.reserve,
                                   rows=plan.rows, **compaction)
    return DecoderRunner(model, spec, plan.batch, plan.slots, plan.device, reserve=plan.reserve, prefix=prefix,
                         **compaction)
