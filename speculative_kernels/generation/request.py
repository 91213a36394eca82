"""The one place that turns a call into a ready ``SpeculativeLoop``, for ``generate`` and ``SpeculativeDecoder``:
inputs and settings validated once, the architectures checked, the runners sized (memory checked), built and, with
``compile=True``, captured and warmed up."""

import dataclasses
import functools

import torch

from ..ops import backends
from ..ops.randomness import check_seed
from .buffers import initial_slots
from .capabilities import (check_caching, check_deterministic, check_expert_capacity, check_masked_slots, check_model,
                           check_position_table, check_positions, check_seeded_draft, check_window_applied,
                           check_window_holes, position_table_limit, request_path, slot_table_limit)
from .context_processors import build_row_processors, build_warpers
from .decode_experts import DecodeExperts
from .drafter import Drafter, ModelDrafter
from .early_exit import early_exit_draft, requested_exit_layers
from .inputs import (check_batch, check_helpers, check_models, check_token_type, inferred_attention_mask,
                     prepare_prompt, prompt_length, repeat_rows)
from .lookup_drafter import PromptLookupDrafter
from .loop import SpeculativeLoop
from .options import BatchingOptions, CompileOptions, StaticRows
from .prompt_cache import check_prompt_cache, check_prompt_path, take_prompt_cache
from .row_settings import RowSettings
from .runners import capture_steps, make_runner, plan_runners
from .runners.factory import encoder_hidden_size
from .seq2seq_inputs import prepare_seq2seq
from .settings import HF_LOGGER, Plan, resolve_settings
from .stats import PhaseTimer
from .stop_strings import stop_criterion
from .retokenize import TokenizerPair
from .retokenizing_drafter import MappedVocabularyDrafter, RetokenizingDrafter, VocabularyMap
from .vocab import VocabBridge, logit_width, tokenizers_differ, vocabulary_size
from .wrapped_seq2seq import (check_encoder_id_processors, check_encoder_input_keyword, encoder_input_name,
                              source_in_decoder_vocabulary)

SEQ2SEQ_KEYWORDS = ("decoder_input_ids", "decoder_attention_mask", "encoder_outputs")


def check_model_as(role: str, model, path: str, batch: int):
    """``check_model``, its refusal saying which argument it is (a draft of the target's class reads the same)."""
    try:
        return check_model(model, path=path, batch=batch, target=role in ("model", "target"))
    except ValueError as error:
        raise ValueError(f"{role}: {error}") from None


def build_loop(model, draft_model, input_ids: torch.Tensor | None = None, *, num_speculative_tokens=None,
               tokenizer=None, assistant_tokenizer=None, generation_config=None, backend: str = "auto",
               batching: BatchingOptions | None = None, compile_options: CompileOptions | None = None,
               drafter: Drafter | None = None, seed: int | None = None, rows: RowSettings | None = None,
               static_rows: StaticRows | None = None, joins_captured: bool = False, **kwargs) -> SpeculativeLoop:
    """Validate a call of ``generate`` (same arguments; ``compile_options`` for ``compile``) and build its loop,
    prefilled.

    input_ids: [B, L] (decoder-only: the prompts, left-padded with ``attention_mask``; encoder-decoder: the encoder
    input). What drafts: ``draft_model``, or prompt lookup (``prompt_lookup_num_tokens``), or ``drafter`` (a
    ``Drafter`` without a model, e.g. ``NGramDrafter``), exactly one. rows: per-row settings of a batch of separate
    requests (``SpeculativeDecoder.add_request``; ``max_new_tokens`` must then be their largest). static_rows: with
    ``cache_implementation="static"``, allocate the static caches for that many rows of that context, so that rows
    can join the loop in place (``SpeculativeLoop.append_rows``; continuous batching), also with ``compile_options``
    (the captured steps then follow the batch size: ``CompileOptions.dynamic``). joins_captured: this loop's rows
    will join a loop with captured steps (the static cache; built as such a loop is, e.g. prompt lookup at its full
    width, but run eagerly).
    Everything is checked before anything is allocated; the encoders run once the checks have passed.
    """
    check_helpers(tokenizer, assistant_tokenizer, batching)
    seed = check_seed(seed)
    lookup_given = kwargs.get("prompt_lookup_num_tokens",
                              getattr(generation_config, "prompt_lookup_num_tokens", None)) is not None
    exit_layers = requested_exit_layers(model, generation_config, kwargs, drafting=draft_model is not None
                                        or drafter is not None, lookup_given=lookup_given)
    if exit_layers is not None:  # the target's first layers draft (early_exit.py)
        check_models(model, None, early_exit=True)  # (a torch.compile wrapper or a non-model refused as such, before its view)
        draft_model = early_exit_draft(model, exit_layers)
    check_models(model, draft_model)
    if drafter is not None and draft_model is not None:
        raise ValueError("pass either draft_model (or assistant_model) or drafter, not both")
    attention_mask = kwargs.pop("attention_mask", None)
    if "inputs" in kwargs:
        if input_ids is not None:
            raise ValueError("pass either input_ids or inputs, not both")
        input_ids = kwargs.pop("inputs")
    features = encoder_input_name(model)  # (a vision or speech wrapper's encoder input: pixel_values, ...)
    check_encoder_input_keyword(model, features, kwargs)
    if features != "input_ids" and features in kwargs:
        if input_ids is not None:
            raise ValueError(f"pass either {features} or input_ids (the positional input), not both")
        input_ids = kwargs.pop(features)  # (the encoder input, as input_ids is for the other encoder-decoders)
    tokens_in = features == "input_ids"
    if tokens_in:
        check_token_type("input_ids", input_ids)
    encoder_decoder = model.config.is_encoder_decoder
    seq2seq_inputs = {name: kwargs.pop(name, None) for name in SEQ2SEQ_KEYWORDS} if encoder_decoder else {}
    # the call's own cache_implementation, as opposed to a checkpoint default (which compile overrides)
    cache_given = bool(kwargs.get("cache_implementation") or getattr(generation_config, "cache_implementation", None))
    prompt_cache = take_prompt_cache(kwargs)  # (name, cache) or None: past_key_values / cache
    settings = resolve_settings(model, num_speculative_tokens, generation_config, kwargs, draft_model, drafter)
    if encoder_decoder and not tokens_in:  # (a vision or speech wrapper: no source ids for HF's encoder processors)
        check_encoder_id_processors(model, features, settings.config)
    if prompt_cache is not None:
        check_prompt_path(prompt_cache[0], encoder_decoder=encoder_decoder,
                          cache_implementation=settings.config.cache_implementation,
                          compiled=compile_options is not None or joins_captured, rows=rows is not None)
    retokenize = draft_model is not None and tokenizers_differ(tokenizer, assistant_tokenizer)
    if retokenize:
        check_retokenizing(model, draft_model, exit_layers is not None, settings, compile_options, joins_captured)
    elif settings.lookbehind.given:
        name = settings.lookbehind.given[0]
        raise ValueError(f"{name} applies to a draft model with another tokenizer (draft_model= with tokenizer= and "
                         "a different assistant_tokenizer=) only; it would change nothing here")
    if settings.prompt_lookup is not None and drafter is not None:
        raise ValueError("pass either drafter or prompt_lookup_num_tokens, not both")
    if draft_model is None and drafter is None and settings.prompt_lookup is None:
        raise ValueError("draft_model (or assistant_model) is required, or prompt_lookup_num_tokens= (prompt lookup, "
                         "no draft model), or drafter= (a Drafter of your own)")
    if tokens_in:
        _warn_batch_without_mask(settings, input_ids, attention_mask)  # (HF's, on the caller's rows: before copies)
    copies = settings.num_return_sequences
    if copies > 1 and rows is not None:
        raise ValueError("num_return_sequences is not supported with per-row settings (a batch of separate requests)")
    if copies > 1 and encoder_decoder:  # HF repeats every input of the encoder and the decoder
        if input_ids is None and seq2seq_inputs.get("encoder_outputs") is None:
            raise ValueError("num_return_sequences > 1 needs input_ids (or encoder_outputs) for an encoder-decoder")
        input_ids, attention_mask = repeat_rows(input_ids, copies), repeat_rows(attention_mask, copies)
        seq2seq_inputs = {name: repeat_rows(value, copies) for name, value in seq2seq_inputs.items()}
        # a per-row decoder_start_token_id ([B], one per prompt) follows its prompt's copies, as in HF
        start = settings.config.decoder_start_token_id
        if isinstance(start, (list, tuple)) or (isinstance(start, torch.Tensor) and start.dim() == 1):
            settings.config.decoder_start_token_id = (
                start.repeat_interleave(copies) if isinstance(start, torch.Tensor)
                else [s for s in start for _ in range(copies)])
    inferred_from = None
    if attention_mask is None and not encoder_decoder:  # as HF (decoder-only): padding marked by pad_token_id
        inferred = inferred_attention_mask(input_ids, settings.pad_token_id, settings.eos_token_ids)
        if inferred is not None:
            attention_mask, inferred_from = inferred, settings.pad_token_id
    encoder_input = (input_ids, attention_mask)  # prompt lookup searches the encoder input too
    if encoder_decoder:  # the loop's prompt is the decoder's
        prompt = prepare_seq2seq(model, draft_model, input_ids, attention_mask, settings.config, **seq2seq_inputs)
        plan = settings.plan(model, prompt.decoder_ids.shape[1])
        check_expert_capacity(model, prompt.decoder_ids.shape[1], plan.max_gamma)
        input_ids, attention_mask = prompt.decoder_ids, prompt.decoder_mask
    else:
        plan = settings.plan(model, prompt_length(input_ids))
        check_expert_capacity(model, prompt_length(input_ids), plan.max_gamma)
        from_bos = attention_mask is None and (input_ids is None or input_ids.numel() == 0)
        input_ids, attention_mask = prepare_prompt(model, input_ids, attention_mask, settings.config.bos_token_id,
                                                   inferred_from)
        if from_bos and inferred_attention_mask(input_ids, settings.pad_token_id, settings.eos_token_ids) is not None:
            # HF starts from [[bos]] and then infers the mask from pad_token_id: it masks the BOS it starts from
            raise ValueError(f"input_ids is empty and bos_token_id equals pad_token_id ({settings.pad_token_id}), "
                             "which is not an EOS id: model.generate starts from the BOS token and then masks it as "
                             "padding (the attention mask it infers from pad_token_id), so it decodes from an "
                             "all-padding prompt, which is refused here; pass input_ids=[[bos_token_id]] with "
                             "attention_mask=[[1]], or another pad_token_id")
        if copies > 1:  # (after the prompt is made: an empty one starts from BOS, then is repeated, as in HF)
            input_ids, attention_mask = repeat_rows(input_ids, copies), repeat_rows(attention_mask, copies)
    if isinstance(plan.num_speculative_tokens, int):
        # No iteration drafts more than max_new_tokens - 1 tokens (the loop caps each one by the most tokens a row has
        # left, as HF does, and each row of a batch of requests by its own): nothing is sized for more, so a gamma far
        # above what is left costs nothing. A batch of requests on the static cache takes requests of up to
        # max_context tokens; rows joining a dynamic one that may draft more grow it (SpeculativeLoop.append_rows).
        capped = (min(plan.num_speculative_tokens, max(1, plan.max_new_tokens - 1)) if static_rows is None
                  else static_rows.gamma(plan.num_speculative_tokens))
        if capped < plan.num_speculative_tokens:
            plan.gamma_setting, plan.num_speculative_tokens = plan.num_speculative_tokens, capped
    batch, width = input_ids.shape
    device = input_ids.device
    stop = None
    if plan.stop_strings and rows is None:  # (a batch of requests: the batcher checks each request's own)
        stop = stop_string_criterion(plan.stop_strings, tokenizer)
        if any(type(criterion) is type(stop) for criterion in plan.stopping_criteria):
            stop = None  # (HF's _merge_criteria_processor_list: the caller's StopStringCriteria replaces this one)
    if plan.stop_strings and rows is None and batch > 1 and plan.generation_config.eos_token_id is None:
        raise ValueError(f"stop_strings with a batch of {batch} rows and eos_token_id=None is not supported: without "
                         "an EOS id model.generate pads nothing, so a row that met its stop string goes on with the "
                         "model's own tokens until every row has stopped, which the loop does not do (it ends the "
                         "row there); set eos_token_id (pad_token_id then fills a stopped row, as in HF), or pass "
                         "one prompt per call (SpeculativeDecoder.add_request runs each request alone)")
    # The encoder input on the device (ids [B, S], real [B, S]) or None: prompt lookup searches it, HF's encoder
    # processors read it.
    source = _encoder_prefix(*encoder_input, device) if encoder_decoder and tokens_in else None
    # (prompt lookup proposes the source's ids only where they are the decoder's too)
    encoder_prefix = source if source is not None and source_in_decoder_vocabulary(model) else None
    if rows is None:  # (a batch of separate requests carries each row's own, built for the request alone)
        encoder_ids = input_ids if not encoder_decoder else None if source is None else source[0]
        processors = build_row_processors(model, plan, input_ids, attention_mask, encoder_ids)
        warpers = build_warpers(model, plan, width, device)
    else:
        processors = warpers = None
    static = wants_static(plan, compile_options, cache_given)
    prefix = None if prompt_cache is None else check_prompt_cache(*prompt_cache, model, input_ids, attention_mask,
                                                                    copies)
    if static_rows is not None and (not static or rows is None):
        raise ValueError("static_rows needs cache_implementation='static' and per-row settings (rows=)")
    if joins_captured and (compile_options is not None or not static or rows is None):
        raise ValueError("joins_captured is for an eager loop on the static cache with per-row settings (rows=)")
    captured_layout = compile_options is not None or joins_captured
    models = (model,) if draft_model is None else (model, draft_model)
    path = request_path(static, captured_layout)
    # Requests (rows=) join a running batch (continuous batching): they are driven as a batch whatever their number
    checked_batch = batch if rows is None else max(batch, 2)
    specs = tuple(check_model_as(role, m, path, checked_batch) for role, m in zip(("model", "draft_model"), models))
    if retokenize and specs[-1].recurrent:
        raise ValueError(f"draft_model ({specs[-1].architecture}) keeps recurrent states, which are rolled back to "
                         "snapshots taken in the current iteration only, and a draft with another tokenizer "
                         "(assistant_tokenizer=) re-tokenizes the text and may drop tokens of earlier ones: use a "
                         "draft without recurrent states there, or one sharing the target's tokenizer")
    if prompt_cache is not None and specs[0].recurrent:  # (its states are neither read nor extended: refused)
        raise ValueError(f"{prompt_cache[0]} (a cache of the prompt's first tokens) is not supported for "
                         f"{specs[0].architecture}, which keeps recurrent states: pass the whole prompt without it")
    if specs[0].prompt_remainder_first and plan.prefill_chunk_size == 1 and width > 1:
        raise ValueError(f"prefill_chunk_size=1 cannot run {specs[0].architecture}'s prompt as model.generate does: "
                         "its Mamba2 mixers clamp dt to time_step_limit in a forward over several tokens (model."
                         "generate's prefill over the whole prompt; transformers' own chunked prefill fails on a model "
                         "without attention layers) but not in a one-token forward after the first; use "
                         "prefill_chunk_size >= 2 or None")
    check_deterministic(model)
    check_seeded_draft(draft_model, None if plan.sampling.greedy and rows is None else seed)  # (greedy: exact)
    check_caching(model)
    check_caching(draft_model, "draft_model")
    new = rows.max_new_tokens if rows is not None else [plan.max_new_tokens] * batch
    # (the target's windows: a draft's only change its proposals). A batch of requests: each row spans its own
    # prompt (from its first real token: the left padding among them is no hole) and new tokens, as it did alone
    if rows is None or attention_mask is None:
        spans = [width + max(new, default=0) - 1] * batch
    else:
        first = (attention_mask.to(torch.int64).cumsum(dim=1) == 0).sum(dim=1).tolist()
        spans = [width - f + n - 1 for f, n in zip(first, new)]
    check_window_holes(specs[0], attention_mask, spans)
    if rows is None:  # (a batch of requests pads them for our own masks alone: each was checked by add_request)
        # (a draft's masked slots change only which drafts are accepted, but a recurrent draft's state takes none)
        for spec in specs[:1] + tuple(spec for spec in specs[1:] if spec.recurrent):
            check_masked_slots(spec, attention_mask)
    check_window_applied(specs[0], max(spans, default=0))
    real = [width] * batch if attention_mask is None else attention_mask.sum(dim=1).tolist()  # prompt lengths
    # The longest forward model.generate runs (a row's prompt and new tokens but its last); our first forward is
    # the longest prompt but its last token (per request only: a batch of requests shares its forwards).
    # In a batch (and a batch of requests, which others join), gamma follows the row with the most tokens left, so a
    # row near its end is verified with drafts past its last position: those must be positions the model can take
    # (in one call every row has the same max_new_tokens, so a row at its end has a batch-mate with at most
    # max_new_tokens - 1 tokens left: at most max_new_tokens - 2 drafts past it; requests joining a batch: gamma)
    overshoot = (plan.max_gamma if rows is not None else min(plan.max_gamma, max(0, plan.max_new_tokens - 2))
                 if batch > 1 else 0)
    check_positions(model, max(r + n - 1 for r, n in zip(real, new)),
                    shortest=max(real) - 1 if rows is None else None, overshoot=overshoot)
    token_source = encoder_decoder and tokens_in and encoder_input[0] is not None  # (an encoder's position table)
    encoder_width = encoder_input[0].shape[1] if token_source else None
    # (a draft with another tokenizer counts other tokens: its drafter stops drafting a row at its table's end)
    for m, name in zip(models[:1] if retokenize else models, ("model", "draft_model")):
        check_position_table(m, max(r + n - 1 for r, n in zip(real, new)), name, encoder_width, overshoot=overshoot)
    batching = batching or BatchingOptions()
    timer = PhaseTimer(device)  # the loop's: an encoder pass over the source is prefill time (total_time_s)
    encoded = {}
    if encoder_decoder and static and not token_source:
        # a vision or speech source (or encoder_outputs given): the length S that sizes the decoders' cross-attention
        # K/V is the encoder output's, known once the encoder has run: encode before sizing the static caches
        encoded = _encode(prompt, timer)
    runner_plan = plan_runners(models, specs, static=static, batch=batch, prompt_width=width,
                               max_new_tokens=plan.max_new_tokens, gamma=plan.max_gamma,
                               slots=initial_slots(width, plan.max_gamma, plan.max_new_tokens), batching=batching,
                               device=device, static_rows=static_rows, captured=compile_options is not None,
                               prefill_chunk_size=plan.prefill_chunk_size,
                               sources=_sources(models, encoded, encoder_width) if encoder_decoder else ())
    check_batch(plan, batch, rows)
    impl = backends.implementation(backend, device.type)
    if encoder_decoder and not encoded:
        encoded = _encode(prompt, timer)
    encoder_mask = prompt.encoder_mask if encoder_decoder else None
    runners = [make_runner(m, spec, runner_plan, encoded.get(id(m)), encoder_mask, prefix=prefix if i == 0 else None)
               for i, (m, spec) in enumerate(zip(models, specs))]  # (the draft prefills the whole prompt)
    target_runner = runners[0]
    dtype = next(model.parameters()).dtype  # verification runs in the target's dtype
    # (one call's iterations never verify more than max_new_tokens - 1 drafts: capture and warm up no wider, or the
    #  warm-up after the prefill reaches positions the request never does)
    steps = []
    if compile_options is not None:  # (a fixed gamma: compile refuses "auto")
        gamma = plan.num_speculative_tokens
        captured_gamma = gamma if rows is not None else min(gamma, max(0, plan.max_new_tokens - 1))
        steps = [(target_runner, [(captured_gamma + 1, False)])]
    if retokenize:  # (the target's text re-tokenized for the draft: ``retokenizing_drafter.py``)
        pair = tokenizer_pair(tokenizer, assistant_tokenizer, draft_model, settings, logit_width(model))
        limit = position_table_limit(draft_model)
        embeddable = vocabulary_size(draft_model)  # (its tokenizer may hold more ids: fed as id 0)
        limits = dict(position_limit=limit, embeddable=embeddable, slot_limit=slot_table_limit(draft_model))
        if plan.sampling.greedy:  # HF's UAD: drafts turned into target tokens through their text
            drafter = RetokenizingDrafter(runners[1], pair, device, prefill_chunk_size=plan.prefill_chunk_size,
                                          **limits)
        else:  # HF's USD: drafts drawn from the draft's q over the tokens both vocabularies have
            vocabulary = VocabularyMap(tokenizer, assistant_tokenizer, logit_width(model), logit_width(draft_model),
                                       device)
            if vocabulary.size == 0:
                raise ValueError("tokenizer and assistant_tokenizer have no token in common: do_sample=True drafts "
                                 "from the draft's distribution over the tokens both vocabularies have (HF's USD)")
            drafter = MappedVocabularyDrafter(runners[1], pair, vocabulary, logit_width(model), dtype, device,
                                              prefill_chunk_size=plan.prefill_chunk_size, **limits)
    elif draft_model is not None:
        bridge = VocabBridge(model, draft_model, tokenizer, assistant_tokenizer)
        # (a greedy request's verification reads no q; a batch of requests may mix in sampled rows)
        drafter = ModelDrafter(runners[1], bridge, dtype, keep_logits=rows is not None or not plan.sampling.greedy,
                               prefill_chunk_size=plan.prefill_chunk_size)
        steps.append((runners[1], ModelDrafter.CAPTURED_SHAPES))
    elif settings.prompt_lookup is not None:
        # (rows joining a batch of requests that may propose more widen it: ``PromptLookupDrafter.add_rows``)
        drafter = PromptLookupDrafter(min(settings.prompt_lookup.num_tokens, plan.max_gamma),
                                      settings.prompt_lookup.max_ngram,
                                      prefix=encoder_prefix, max_new_tokens=plan.max_new_tokens, backend=backend,
                                      compiled=captured_layout)
    # else: the caller's drafter (a Drafter without a model), used as given
    warm_up = None
    if compile_options is not None:  # captured after the prefill; fixed shapes, so no row leaves the batch
        warm_up = functools.partial(capture_steps, steps, compile_options, device)
        batching = dataclasses.replace(batching, drop_finished_fraction=None)
    return SpeculativeLoop(target_runner, drafter, plan, input_ids, attention_mask, vocab=logit_width(model),
                           dtype=dtype, impl=impl, batching=batching, warm_up=warm_up, seed=seed, rows=rows,
                           processors=processors, warpers=warpers, stop=stop, decode_experts=DecodeExperts(models),
                           timer=timer, caller_cache=prompt_cache,
                           first_token_from_prompt=specs[0].bounded_step_size,
                           prompt_remainder_first=specs[0].prompt_remainder_first)


def check_retokenizing(model, draft_model, early_exit: bool, settings, compile_options,
                       joins_captured: bool) -> None:
    """ValueError naming what a draft with another tokenizer (``retokenizing_drafter.py``) does not support."""
    what = "a draft model with another tokenizer (assistant_tokenizer= with another vocabulary than tokenizer=)"
    if early_exit:
        raise ValueError(f"assistant_early_exit drafts with the target's own vocabulary; {what} is another draft: "
                         "pass one of them")
    if model.config.is_encoder_decoder or draft_model.config.is_encoder_decoder:
        raise ValueError(f"{what} is supported for decoder-only models only (an encoder-decoder target or draft "
                         "was given)")
    if settings.config.cache_implementation == "static":
        raise ValueError(f"cache_implementation='static' is not supported with {what}: its draft's cache grows by "
                         "a varying number of tokens per iteration; use the dynamic cache")
    if compile_options is not None:
        raise ValueError(f"compile=True is not supported with {what} (its draft feeds a varying number of tokens "
                         "per iteration)")
    if joins_captured:
        raise ValueError(f"a captured batch of requests (SpeculativeDecoder with compile) is not supported with {what}")


def tokenizer_pair(tokenizer, assistant_tokenizer, draft_model, settings, width: int) -> TokenizerPair:
    """The re-tokenizing drafter's tokenizers and settings: the draft's EOS ids (its tokenizer's and its
    generation_config's), the target's first EOS id it can emit (< width, its logit width) proposed in their place,
    the lookbehind windows."""
    draft_eos = set()
    for value in (assistant_tokenizer.eos_token_id, getattr(draft_model.generation_config, "eos_token_id", None)):
        draft_eos.update(value if isinstance(value, (list, tuple)) else () if value is None else (value,))
    starter = next((t for t in (assistant_tokenizer.bos_token_id, assistant_tokenizer.eos_token_id) if t is not None),
                   0)
    target_eos = next((e for e in settings.eos_token_ids or () if 0 <= e < width), None)
    return TokenizerPair(tokenizer, assistant_tokenizer, target_lookbehind=settings.lookbehind.target,
                         assistant_lookbehind=settings.lookbehind.assistant, draft_eos=frozenset(draft_eos),
                         target_eos=target_eos, starter=starter, target_width=width)


def stop_string_criterion(stop_strings, tokenizer):
    """HF's ``StopStringCriteria`` for ``stop_strings`` (a tuple of strings) on ``tokenizer``, which
    ``model.generate`` requires for them too."""
    if tokenizer is None:
        raise ValueError(f"stop_strings={list(stop_strings)!r} needs tokenizer= (the target's tokenizer; a "
                         "SpeculativeDecoder takes it at construction, SpeculativeDecoder(..., tokenizer=)), as "
                         "model.generate does, to find the strings in the tokens")
    return stop_criterion(stop_strings, tokenizer)


def _encode(prompt, timer: PhaseTimer) -> dict:
    """The encoders' outputs ({id(model): BaseModelOutput}, ``Seq2SeqPrompt.encode``), timed as prefill."""
    timer.start("prefill")
    encoded = prompt.encode()
    timer.stop("prefill")
    return encoded


def _sources(models, encoded: dict, token_width: int | None) -> tuple[tuple[int, int], ...]:
    """Each model's encoder output size (S, H), for the static caches' memory check (``plan_runners``): read off its
    output where encoded, else the token source's width and the encoder's config; () where neither is known (the
    dynamic cache, which sizes nothing, with a vision or speech source)."""
    if encoded:
        return tuple(tuple(encoded[id(m)].last_hidden_state.shape[1:]) for m in models)
    if token_width is None:
        return ()
    return tuple((token_width, encoder_hidden_size(m)) for m in models)


def _encoder_prefix(input_ids, attention_mask, device):
    """(ids [B, S], real [B, S]) of the encoder input for prompt lookup to search, or None without input_ids."""
    if input_ids is None:
        return None
    ids = input_ids.to(device=device, dtype=torch.int64)
    real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device) != 0
    return ids, real


def wants_static(plan: Plan, compile_options: CompileOptions | None, cache_given: bool = True) -> bool:
    """Whether the request runs on the static cache: ``cache_implementation="static"`` or compiling (captured steps
    need the static cache's fixed shapes). Raises ValueError for combinations that cannot work. cache_given: the
    call passed cache_implementation (False: a checkpoint default, and a generation_config's "dynamic" then
    yields to compile, as any default yields to an argument)."""
    if compile_options is not None and plan.cache_implementation == "dynamic" and cache_given:
        raise ValueError("compile=True captures fixed shapes and needs the static cache; "
                         "do not combine it with cache_implementation='dynamic'")
    if plan.cache_implementation != "static" and compile_options is None:
        return False
    if not isinstance(plan.num_speculative_tokens, int):  # "auto": gamma changes while decoding
        if compile_options is not None:
            what = "compile=True needs"
        elif cache_given:
            what = "the static cache (cache_implementation 'static', 'sliding_window' or 'hybrid_chunked') needs"
        else:  # (the checkpoint's default, which the call may override)
            what = ("the static cache (cache_implementation='static' from the model's generation_config; pass "
                    "cache_implementation='dynamic' to use the dynamic one) needs")
        raise ValueError(f"{what} a fixed num_speculative_tokens (the cache is sized and the steps are captured for "
                         f"it), got {plan.num_speculative_tokens!r}")
    return True


def _warn_batch_without_mask(settings, input_ids, attention_mask) -> None:
    """model.generate's warnings (``_prepare_special_tokens``) for a batch given without an attention_mask: no
    pad_token_id either (it pads with the EOS id), or a pad id that is an EOS id (no padding can be inferred)."""
    batched = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 1
    if attention_mask is not None or not batched or not settings.eos_token_ids:
        return
    if settings.config.pad_token_id is None:
        HF_LOGGER.warning("The attention mask and the pad token id were not set, with a batched input. As a "
                          "consequence, you may observe unexpected behavior. Please pass your input's "
                          "`attention_mask` to obtain reliable results.")
    if settings.pad_token_id in settings.eos_token_ids:
        HF_LOGGER.warning_once("The attention mask is not set with a batched input, and cannot be inferred from input "
                               "because pad token is same as eos token. As a consequence, you may observe unexpected "
                               "behavior. Please pass your input's `attention_mask` to obtain reliable results.")
