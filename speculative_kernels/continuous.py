"""Continuous batching for ``SpeculativeDecoder``: requests join and leave a running batch between steps.

    decoder = SpeculativeDecoder(target, draft, num_speculative_tokens=4, max_batch_size=16)
    a = decoder.add_request([1, 4, 3], max_new_tokens=64, do_sample=True, temperature=0.7, seed=1)
    b = decoder.add_request(torch.tensor([5, 9]), max_new_tokens=32)          # greedy (the model's defaults)
    while decoder.has_work():
        for request_id, tokens in decoder.step().items():                     # new tokens of each request
            # (a step that admits requests returns their first tokens; the running rows emit at the next one)
            send(request_id, tokens)
    decoder.result(a).finish_reason                                           # "eos", "length", "stop", "cancelled"
    static = SpeculativeDecoder(target, draft, num_speculative_tokens=4, max_batch_size=16,
                                cache_implementation="static", max_context=2048)  # K/V for 16 x 2048 (+ slack)

Exactness: a request's output depends only on its own prompt, settings and seed, never on its batch-mates or on
when it joined. Each row carries its own length limit, EOS ids, logits processors and warpers (HF's, built for the
request alone, reading only its own tokens), sampling parameters (per-row ``ops`` tensors), its
Philox key (``randomness.request_key(seed)``: the key of the request decoded alone) and its own random-number
offsets; it is drafted at most its own tokens left less one. A greedy request is token-identical to
``model.generate`` on it alone, a seeded sampled one to ``speculative_kernels.generate`` on it alone with that seed.
With ``num_speculative_tokens="auto"`` the gamma of each iteration follows timings measured while decoding, and a
sampled request's draws with it: its distribution is still exact, but its seeded tokens are reproducible only with
a fixed gamma.

Design: **joining rows are prefilled alone and merged into the running batch.** A step that admits queued requests
builds a loop over the joining requests only (``request.build_loop`` with their ``RowSettings``: their prompts,
left-padded among themselves, keys, zero offsets), which prefills just them in both models and runs its first
iteration on their rows alone, so that their first tokens come from the admitting step (time to first token: their
own prefill and iteration, not an iteration of the whole batch; the running rows emit again at the next step). When
every joining request is greedy, that first iteration drafts nothing: the first token comes from the target's
forward over the whole prompts, as in ``model.generate``, so the admitting step costs just the two prefills (sampled
requests keep their drafted first iteration: their random numbers must be those of the request alone). Its
rows still running (not finished by that iteration: max_new_tokens=1, an EOS, a stop string) are then appended to
the running loop (``SpeculativeLoop.append_rows``, the counterpart of ``keep_rows``): every per-row state (output
buffers, counts, limits, EOS ids, sampling tensors, keys and offsets, the logit masks) is concatenated, and the
runners and the drafter join their rows (``Runner.add_rows``, ``Drafter.add_rows``): the side whose KV cache has
fewer slots is padded on the left with holes (masked slots; positions stay each row's own), as left padding is. The
running rows are not forwarded again: admission costs the joining prompts' prefill and a copy of the caches (one
layer at a time). Requests arriving together are admitted in one merge. Leaving is cheap too: a finished or
cancelled request's row is removed from the caches and buffers at once (``SpeculativeLoop.keep_rows`` -> the runners'
``select_rows``); the holes a merge leaves are squeezed out by the runners' hole compaction like any others (also for
a row left alone).

Admission: at most ``max_batch_size`` requests run at once; the others wait in a FIFO queue and are admitted as rows
free up. The joining loop goes through ``build_loop``'s free-memory check of the caches and buffers it sizes (and
its prefill and first iteration allocate); when they run out of memory, fewer of the queue's first requests are
tried, and when not even the first one fits while rows run, it waits and the running batch steps (rows that leave
free memory; the next step tries again), as a serving engine's FIFO scheduler does. A first request that cannot be
admitted with no row running (out of memory alone), or whose loop fails otherwise, leaves the queue with
finish_reason "error" and the reason in its result's ``error``; the requests behind it go on (as does a running
request whose own logits leave no token to emit: the others go on without it). The merge itself then
allocates the joined caches layer by layer (one layer's extra copy at a time); should that fail, neither loop can go on:
the running and the joining requests finish with finish_reason "error" (their tokens so far kept in ``result``)
and the error propagates from ``step``, as for any step that raises midway.

Static cache (``SpeculativeDecoder(..., cache_implementation="static", max_context=N)``): the running loop's
runners allocate K/V, slot masks and positions for ``max_batch_size`` rows of ``static_capacity(N, 0, gamma,
max_batch_size, slack)`` slots once (``StaticRows``; the free-memory check of ``build_loop`` runs first: a request
that does not fit waits or fails as above), and the batch uses their first B rows (views). ``add_request`` refuses a
prompt plus ``max_new_tokens`` longer than N by name. A joining loop is prefilled and stepped on static caches of its
own size, then its rows are copied into the free rows at the shared write pointer (``StaticDecoderRunner.add_rows``:
holes on the left of the side with fewer slots; when the joining rows hold more, the running rows move right within
their rows first); leaving rows are removed by moving the remaining ones to the front in place. The allocation lives
until a merge fails midway (then the next request allocates and checks it again): a batch that empties keeps it,
with no rows (``SpeculativeLoop.keep_rows([])``), and the next requests join it (should their own static cache
not fit beside it, out of memory, the idle allocation is freed and they build a new running loop, as on a fresh
decoder). With ``compile`` (a setting of
the decoder, with the static cache only) the running loop's steps are captured (automatic dynamic shapes);
joining loops are built for it (``build_loop(joins_captured=True)``) but run eagerly. Encoder-decoder targets are
refused (their rows are kept right-aligned and hole-free, which a merge would have to realign).

Threads: the public methods hold one re-entrant lock, so a server's threads may call them at any time (an HTTP
handler's ``add_request``, ``cancel`` or ``result`` while the engine thread is inside ``step``): a call from another
thread waits for the running step to end, then runs between two steps, as vLLM's engine applies aborts between its
steps. A callback of the running step (a hook, a drafter), on the stepping thread itself, may read and queue
(``result``, ``add_request``) but ``step`` and ``cancel`` from there are refused by name; a callback must not wait
for another thread that calls the decoder (that thread waits for the step: a deadlock).
"""

import dataclasses
import functools
import operator
import threading

import torch

from .generation.autocast_state import AutocastState
from .generation.capabilities import (check_caching, check_deterministic, check_position_table, check_positions,
                                       check_seeded_draft,
                                       check_masked_slots, check_window_applied, check_window_holes,
                                       request_path)
from .generation.drafter import Drafter
from .generation.inputs import check_models, inferred_attention_mask, model_device
from .generation.loop import JoinRefused, SpeculativeLoop
from .generation.memory import is_out_of_memory
from .generation.options import BatchingOptions, CompileOptions, StaticRows
from .generation.hooks import hooks_reason, row_hooks_reason
from .generation.request import build_loop, check_model_as
from .generation.row_settings import RowSettings
from .generation.runners.factory import check_slot_tables
from .generation.runners.sizing import static_capacity
from .generation.context_processors import build_row_processors, build_warpers
from .generation.settings import CONTEXT_PROCESSED, WARPERS, resolve_settings
from .generation.settings import stop_strings as parse_stop_strings
from .generation.stop_strings import completes_stop_string, stop_criterion
from .generation.vocab import logit_width, vocabulary_size
from .ops.randomness import check_seed, request_key

REQUEST_KEYWORDS = ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed",
                    "eos_token_id", "stop_strings", "prefill_chunk_size", *CONTEXT_PROCESSED, *WARPERS)
DECODER_SETTINGS = {  # keyword -> where it goes instead of add_request
    "compile": "the batch's steps are captured or not for every request: pass compile=True to SpeculativeDecoder "
               "(with cache_implementation='static' and max_context)",
}


@dataclasses.dataclass
class RequestResult:
    """What ``SpeculativeDecoder.result`` returns. token_ids: the generated ids so far (the prompt excluded);
    finish_reason: "eos", "length", "stop" (a stop string), "cancelled", "error" (it could not be admitted,
    its own logits left no token to emit, or a step of its batch raised midway, which ends every request running
    in it with the tokens it had received: ``error`` says why), or None while queued or running; iterations: the steps it took part in; drafted_tokens /
    accepted_tokens: drafts verified for it (at most its tokens left less one per step) / those it kept, counted
    as ``SpeculationStats.drafted_tokens`` / ``accepted_tokens`` count them (drafts cut by its EOS or a stop string
    are not kept); error: "ExceptionType: message" when finish_reason is
    "error", else None."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    iterations: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Request:
    result: RequestResult
    max_new_tokens: int
    eos: frozenset
    temperature: float  # 0: greedy
    top_k: int
    top_p: float
    min_new_tokens: int
    key: int
    stop: object | None = None  # HF's StopStringCriteria of the request's stop_strings
    mask: list[int] | None = None  # the prompt's attention mask where HF infers one from pad_token_id, else None
    processors: list = dataclasses.field(default_factory=list)  # HF's logits processors of the request alone
    warpers: object | None = None  # HF's warper chain (Warpers), when a warper the ops lack is set
    # HF's prefill_chunk_size (the request's, else the model's generation_config's): requests admitted together
    # are prefilled together, in chunks of the smallest one given among them (None: one forward)
    prefill_chunk_size: int | None = None


def _locked(method):
    """Run ``method`` holding the batcher's lock (see Threads in the module docstring)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class ContinuousBatcher:
    """The continuous-batching state of one ``SpeculativeDecoder`` (see the module docstring)."""

    def __init__(self, decoder, max_batch_size: int, cache_implementation: str | None = None,
                 max_context: int | None = None, compile=False):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if cache_implementation not in (None, "dynamic", "static"):
            raise ValueError(f"cache_implementation must be None, 'dynamic' or 'static', got {cache_implementation!r}")
        self.static_rows = None  # the static caches' rows and context (StaticRows), None on the dynamic cache
        if cache_implementation == "static":
            if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
                raise ValueError("cache_implementation='static' needs max_context, an int >= 2 (the most tokens, "
                                 f"prompt plus max_new_tokens, of any request), got {max_context!r}")
            if not isinstance(decoder.num_speculative_tokens, int) and decoder.num_speculative_tokens is not None:
                raise ValueError("cache_implementation='static' needs a fixed num_speculative_tokens (the caches are "
                                 f"sized for it), got {decoder.num_speculative_tokens!r}")
            self.static_rows = StaticRows(max_batch_size, max_context)
        elif max_context is not None:
            raise ValueError("max_context sizes the static cache: pass it with cache_implementation='static'")
        self.compile_options = CompileOptions.from_argument(compile)
        if self.compile_options is not None and self.static_rows is None:
            raise ValueError("compile=True captures the steps of a batch whose rows join and leave in place: pass "
                             "cache_implementation='static' and max_context with it")
        self.decoder = decoder
        self.max_batch_size = max_batch_size
        self._requests: dict[int, _Request] = {}
        self._queue: list[int] = []  # waiting to join, in arrival order
        self._rows: list[int] = []  # request id of each row of the running loop
        self._loop: SpeculativeLoop | None = None
        self._next_id = 0
        self._target_spec = None  # the target's ModelSpec, from the first add_request's check
        self._stepping = False  # inside step(): callbacks (hooks, drafters) must not change the batch
        self._autocast: AutocastState | None = None  # the running batch's (``step``)
        self._lock = threading.RLock()  # held by every public method: other threads wait for a running step

    # ------------------------------------------------------------------------------------------- requests
    @_locked
    def add_request(self, prompt_ids, **kwargs) -> int:
        target = self.decoder.target
        if target.config.is_encoder_decoder:
            raise ValueError("add_request supports decoder-only targets; use start() for encoder-decoder models")
        self._check_models()
        check_deterministic(target)  # (per request: the model may have been put in training mode meanwhile)
        check_caching(target)
        check_caching(self.decoder.draft, "draft")
        for name in kwargs:
            if name in DECODER_SETTINGS:
                raise ValueError(f"{name} is a setting of the decoder, not of a request ({DECODER_SETTINGS[name]})")
            if name not in REQUEST_KEYWORDS:
                raise ValueError(f"{name} is not a keyword add_request takes; it takes {', '.join(REQUEST_KEYWORDS)}")
        prompt = self._check_prompt(prompt_ids)
        seed = check_seed(kwargs.pop("seed", None))
        if kwargs.get("stop_strings") is not None:  # (refused by name before the settings resolve: they may warn)
            self._check_stop_strings(kwargs["stop_strings"])
        # stop_strings resolve with the other settings: the request's, an explicit None included (none, as in
        # model.generate), else the model's generation_config's
        settings = resolve_settings(target, self.decoder.num_speculative_tokens, None, dict(kwargs),
                                    self.decoder.draft, self.decoder.drafter)
        plan = settings.plan(target, len(prompt))
        self._check_drafting(settings)
        stop = self._stop_criterion(plan.stop_strings) if plan.stop_strings else None
        mask = self._inferred_mask(prompt, settings)
        if mask is not None:  # (pad_token_id inside the prompt: masked, as in HF)
            rows = torch.tensor([mask], device="cpu")  # (host values: never the caller's default device)
            check_window_holes(self._target_spec, rows, len(prompt) + plan.max_new_tokens - 1,
                               name="the attention mask inferred from pad_token_id")
            check_masked_slots(self._target_spec, rows, name="the attention mask inferred from pad_token_id")
        check_window_applied(self._target_spec, len(prompt) + plan.max_new_tokens - 1)
        if plan.stopping_criteria:
            raise ValueError("stopping criteria (e.g. the model's stop_strings) are not supported by add_request yet")
        decoders_cache = "static" if self.static_rows is not None else "dynamic"
        if plan.cache_implementation not in (None, decoders_cache):  # (one the decoder already uses is what it asks)
            written = target.generation_config.cache_implementation  # (a deprecated alias names the static cache)
            alias = ("transformers' deprecated name of its static cache, " if written != plan.cache_implementation
                     else "")
            raise ValueError(f"cache_implementation={written!r} ({alias}from the model's generation config) "
                             f"is not the decoder's ({decoders_cache!r}), and add_request cannot change it: the "
                             "decoder's caches are chosen once, SpeculativeDecoder(..., cache_implementation=...)")
        if self.static_rows is not None and len(prompt) + plan.max_new_tokens > self.static_rows.max_context:
            raise ValueError(f"prompt_ids ({len(prompt)} tokens) plus max_new_tokens ({plan.max_new_tokens}) exceed "
                             f"the decoder's max_context={self.static_rows.max_context} (its static cache's rows)")
        # the most drafts an iteration verifies (a static batch's caches are sized for it: StaticRows.gamma)
        gamma = plan.max_gamma if self.static_rows is None else self.static_rows.gamma(plan.max_gamma)
        if self.static_rows is not None:  # (GPT-Neo, MPT: refused here, not by every request when admitted)
            rows = self.static_rows
            capacity = static_capacity(rows.max_context, 0, gamma, rows.rows, BatchingOptions().slack)
            check_slot_tables((target, self.decoder.draft), ("target", "draft"), capacity,
                              "max_context plus one iteration's slots and the batch's slack",
                              "the decoder's max_context")
        # (every request joins one batch, whose rows near their end are verified with drafts past their last position)
        longest = (len(prompt) if mask is None else sum(mask)) + plan.max_new_tokens - 1
        check_positions(target, longest, overshoot=gamma)
        # (a draft of another tokenizer counts its own tokens: its drafter stops drafting a row at its table's end,
        #  and refuses a prompt whose text is longer than the table, as in generate)
        draft = None if self.decoder.draft_retokenizes else self.decoder.draft
        for model, name in ((target, "target"), (draft, "draft")):
            if model is not None:
                check_position_table(model, longest, name, overshoot=gamma)
        config = plan.generation_config
        forced = [name for name in ("forced_bos_token_id", "forced_eos_token_id")
                  if getattr(config, name, None) is not None]
        if forced:
            raise ValueError(f"{forced[0]} (from the model's generation config) is not supported by add_request yet")
        if plan.watermark:
            raise ValueError("watermarking_config (from the model's generation config) is not supported by add_request "
                             "yet; speculative_kernels.generate and start() apply it")
        if settings.num_return_sequences > 1:
            raise ValueError(f"num_return_sequences={settings.num_return_sequences} (from the model's generation "
                             "config) is not supported by add_request: a request returns one sequence; add the prompt "
                             "once per sequence wanted, each with its own seed")
        if plan.max_time is not None:
            raise ValueError(f"max_time={plan.max_time} (from the model's generation config) is not supported by "
                             "add_request: a server bounds a request by max_new_tokens, or cancels it")
        if plan.renormalize_logits:
            raise ValueError("renormalize_logits=True (from the model's generation config) changes only the scores, "
                             "which add_request does not return; set it to False in the model's generation_config")
        processors, warpers = self._processors(plan, prompt, mask)
        s = plan.sampling  # (neutral when the request's warper chain applies its temperature/top-k/top-p)
        if not s.greedy:  # (greedy output is exact whatever the draft's dropout draws)
            check_seeded_draft(self.decoder.draft, seed, "draft")
        if not s.greedy and s.temperature > torch.finfo(torch.float32).max:
            raise ValueError(f"temperature={s.temperature} exceeds float32's largest value "
                             f"({torch.finfo(torch.float32).max:.3g}), in which a batch holds each request's temperature")
        if seed is None and s.greedy:  # nothing is random: no draw (torch's generator untouched, as in generate)
            seed = 0
        elif seed is None:  # an unseeded sampled request draws its seed from torch's default generator
            seed = int(torch.randint(0, 2**62, (), device="cpu").item())  # (the CPU generator, as generate's)
        request_id = self._next_id
        self._next_id += 1
        # (held in the batch's int64 tensors: top_k >= the vocabulary is no cut, 0; the EOS masks clamp the minimum)
        top_k = 0 if s.top_k >= logit_width(target) else s.top_k
        result = RequestResult(request_id, prompt, [], None)
        self._requests[request_id] = _Request(
            result, plan.max_new_tokens, frozenset(plan.eos_token_ids or ()), 0.0 if s.greedy else s.temperature,
            top_k, s.top_p, plan.min_new_tokens, request_key(seed), stop, mask, processors, warpers,
            plan.prefill_chunk_size)
        if plan.max_new_tokens == 0:
            result.finish_reason = "length"
        else:
            self._queue.append(request_id)
        return request_id

    def _check_models(self) -> None:
        """The architecture check ``generate`` runs (``capabilities.check_model``), once per decoder and for a batch,
        since every request joins one running batch: a model the runners cannot drive exactly is refused by the
        first add_request, before anything is queued or allocated (not by a later step()). The target's forward hooks
        are checked at every add_request (``hooks.hooks_reason``): one may be registered after the first."""
        if self._target_spec is not None:
            for role, model in (("target", self.decoder.target), ("draft", self.decoder.draft)):
                reason = None if model is None else (row_hooks_reason(model) or (
                    hooks_reason(model) if role == "target" else None))
                if reason is not None:
                    raise ValueError(f"{role}: {type(model).__name__} cannot be driven exactly by "
                                     f"speculative_kernels: {reason}")
            return
        d = self.decoder
        check_models(d.target, d.draft, names=("target", "draft"))
        path = request_path(self.static_rows is not None, self.compile_options is not None)
        spec = check_model_as("target", d.target, path, 2)
        if d.draft is not None:
            check_model_as("draft", d.draft, path, 2)
        if d.drafter is not None and (not callable(getattr(drafter := d.drafter(), "add_rows", None))
                                      or getattr(type(drafter), "add_rows", None) is Drafter.add_rows):
            raise ValueError(f"add_request needs a drafter with add_rows (Drafter.add_rows: the rows of requests "
                             f"joining a running batch); {type(drafter).__name__} has none: implement it, or decode "
                             "with start() or generate()")
        self._target_spec = spec  # (set once both pass: a refused decoder checks again at the next add_request)

    def _processors(self, plan, prompt: list[int], mask: list[int] | None):
        """The request's HF logits processors (a list, [] for none: its minimum length is then among them) and
        warper chain (or None), built as ``generate`` builds them for this request alone."""
        device = model_device(self.decoder.target)
        ids = torch.tensor([prompt], dtype=torch.int64, device=device)
        real = torch.ones_like(ids) if mask is None else torch.tensor([mask], device=device)
        row = build_row_processors(self.decoder.target, plan, ids, real, ids)
        processors = row.rows[0] if row is not None else []
        # Some of HF's processors check their settings at their first call (bad_words_ids / sequence_bias holding ids
        # past the logits' width): call each once here, so that add_request refuses such a request, not the step
        # admitting it (and every later one: it would stay queued, blocking the batch)
        scores = torch.zeros(1, logit_width(self.decoder.target), dtype=torch.float32, device=device)
        for processor in processors:
            try:
                processor(ids, scores.clone())
            except ValueError as error:
                raise ValueError(f"{type(processor).__name__}, built from this request's settings: {error}") from None
        return processors, build_warpers(self.decoder.target, plan, len(prompt), device)

    def _check_prompt(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() == 2 and prompt_ids.shape[0] != 1:
                raise ValueError(f"prompt_ids holds {prompt_ids.shape[0]} prompts (shape {tuple(prompt_ids.shape)}): "
                                 "add_request takes one; call it once per prompt")
            if prompt_ids.dim() not in (1, 2) or prompt_ids.is_floating_point() or prompt_ids.is_complex() \
                    or prompt_ids.dtype == torch.bool:
                raise ValueError(f"prompt_ids must be a 1-D integer tensor ([1, n] too) or a list of ints, got a "
                                 f"tensor of shape {tuple(prompt_ids.shape)} and dtype {prompt_ids.dtype}")
            prompt = prompt_ids.reshape(-1).tolist()  # ([1, n]: a tokenizer's return_tensors="pt" row)
        elif isinstance(prompt_ids, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
                raise TypeError("prompt_ids must be a 1-D integer tensor or a list of ints")
            prompt = list(prompt_ids)
        else:
            raise TypeError(f"prompt_ids must be a 1-D integer tensor or a list of ints, got "
                            f"{type(prompt_ids).__name__}")
        vocab = vocabulary_size(self.decoder.target)  # (a multimodal config keeps it in its text config)
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt_ids must be in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
        return prompt

    @staticmethod
    def _inferred_mask(prompt: list[int], settings) -> list[int] | None:
        """What ``model.generate`` on this prompt alone would mask (``inputs.inferred_attention_mask``: the pad id,
        when it is not an EOS id); None for none. A prompt ending with the pad id is refused, as in ``generate``."""
        inferred = inferred_attention_mask(torch.tensor([prompt], device="cpu"), settings.pad_token_id,
                                           settings.eos_token_ids)
        if inferred is None:
            return None
        mask = inferred[0].tolist()
        if not mask[-1]:
            raise ValueError(f"prompt_ids ends with pad_token_id={settings.pad_token_id}: as model.generate would, "
                             "the prompt's mask is inferred from pad_token_id, which makes it right-padded; remove "
                             "the trailing pad ids")
        return mask

    def _check_drafting(self, settings) -> None:
        """A ValueError where nothing drafts for the request: no draft model, drafter, prompt lookup or early exit
        on the decoder, nor a prompt_lookup_num_tokens / assistant_early_exit default in the target's
        generation_config (the request would be accepted, then fail at its step)."""
        d = self.decoder
        if d.draft is None and d.drafter is None and not d.lookup and settings.prompt_lookup is None \
                and getattr(settings.config, "assistant_early_exit", None) is None:
            raise ValueError("the SpeculativeDecoder has nothing to draft with: pass a draft model, "
                             "prompt_lookup_num_tokens=, assistant_early_exit= or drafter= to SpeculativeDecoder(...)")

    def _check_stop_strings(self, stop_strings) -> tuple:
        """stop_strings (a string or a list of them) -> a tuple of them; TypeError for another value, ValueError
        when the decoder has no tokenizer to match them with."""
        strings = parse_stop_strings(stop_strings)
        if self.decoder.tokenizer is None:
            raise ValueError("stop_strings needs the decoder's tokenizer: SpeculativeDecoder(..., tokenizer=...)")
        return strings

    def _stop_criterion(self, stop_strings: tuple):
        """The request's resolved stop strings (non-empty) -> HF's StopStringCriteria on the decoder's tokenizer."""
        return stop_criterion(self._check_stop_strings(list(stop_strings)), self.decoder.tokenizer)

    def _stopped_at(self, request: _Request, new: list[int]) -> int | None:
        """With stop strings: the index in ``new`` (the tokens just emitted, already in the result) of the first
        token that completes one, checked after every token as HF does; else None."""
        result = request.result
        ids = result.prompt_ids + result.token_ids
        start = len(ids) - len(new)
        for j in range(len(new)):
            if completes_stop_string(request.stop, ids[: start + j + 1]):
                return j
        return None

    @staticmethod
    def _key(request_id) -> int:
        """request_id as the int add_request returned (a NumPy or torch integer too); TypeError for a bool or a
        non-integer (True was request 1)."""
        if isinstance(request_id, bool) or isinstance(request_id, torch.Tensor) and request_id.dtype == torch.bool:
            raise TypeError(f"request_id must be an int returned by add_request, got {request_id!r}")
        try:
            return operator.index(request_id)
        except TypeError:
            raise TypeError(f"request_id must be an int returned by add_request, got {type(request_id).__name__}") \
                from None

    def _request(self, request_id: int) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown request_id {request_id!r}")
        return request

    @_locked
    def result(self, request_id) -> RequestResult:
        result = self._request(self._key(request_id)).result
        return dataclasses.replace(result, prompt_ids=list(result.prompt_ids), token_ids=list(result.token_ids))

    @_locked
    def cancel(self, request_id) -> bool:
        """Stop a request (its row and cache slots are freed now). Returns False if it had already finished."""
        request_id = self._key(request_id)
        request = self._request(request_id)
        if request.result.finished:
            return False
        if self._stepping:
            raise RuntimeError(f"cannot cancel request {request_id} from inside a running step() (a hook, a drafter, "
                               "on the stepping thread); cancel it after step() returns")
        request.result.finish_reason = "cancelled"
        if request_id in self._queue:
            self._queue.remove(request_id)
            return True
        try:
            self._leave([request_id])
        except BaseException as error:  # (an allocation in keep_rows) the other rows' state is half-updated
            self._fail_running(error)
            raise
        return True

    @_locked
    def release(self, request_id) -> None:
        """Forget a finished request (its result can no longer be read); a server calls it once it has replied."""
        request_id = self._key(request_id)
        if not self._request(request_id).result.finished:
            state = "queued" if request_id in self._queue else "running"
            raise ValueError(f"request {request_id} is still {state}; cancel it first")
        del self._requests[request_id]

    @property
    @_locked
    def running(self) -> list[int]:
        return list(self._rows)

    @property
    @_locked
    def queued(self) -> list[int]:
        return list(self._queue)

    @_locked
    def has_work(self) -> bool:
        return bool(self._rows or self._queue)

    # ------------------------------------------------------------------------------------------- steps
    @_locked
    def step(self) -> dict[int, list[int]]:
        if self._stepping:
            raise RuntimeError("step() is already running (called from inside a step: a hook, a drafter); call it "
                               "after the running step returns")
        self._stepping = True
        # the running batch's forwards keep the caller's autocast of the step that started it, whatever thread
        # steps it (autocast is per thread; other dtypes in one forward crash inside torch)
        state = self._autocast if self._loop is not None and self._autocast is not None else AutocastState.current()
        try:
            with state.entered():
                return self._step()
        finally:
            self._autocast = state if self._loop is not None else None
            self._stepping = False

    def _step(self) -> dict[int, list[int]]:
        """Admit queued requests, or else run one iteration of the running batch; {request_id: new token ids}.

        A step that admits requests while others run is theirs alone: their loop is prefilled and runs its first
        iteration on their rows only, so their first tokens come from this step at the cost of their own prefill
        and iteration (not one of the whole batch); its rows still running then join the running loop
        (``SpeculativeLoop.append_rows``), whose rows emit again at the next step."""
        if self.decoder.target.training and (self._rows or self._queue):  # (put in training mode since add_request:
            check_deterministic(self.decoder.target)  # refused before anything runs or is admitted)
        if self._loop is not None:
            self._loop.check_before_step()
        if len(self._rows) < self.max_batch_size and self._queue:
            admitted = self._admit()
            if admitted is not None and self._loop is None:
                del self._queue[: len(admitted[0])]
                self._loop, self._rows = admitted[1], list(admitted[0])
            elif admitted is not None:
                return self._join(admitted[1], admitted[0])
        if not self._rows:  # nothing runs (a static loop may wait with no rows)
            return {}
        try:
            with torch.inference_mode():
                self._loop.step()
            new, done = self._collect(self._loop, self._rows)
            if done:
                self._leave(done)
        except BaseException as error:  # e.g. out of memory in a forward or a row's removal: half-updated state
            self._fail_running(error)
            raise
        return new

    def _fail_running(self, error: BaseException, extra: list[int] = ()) -> None:
        """The running loop (and ``extra`` requests joining it) raised midway (tokens, counts, caches or rows
        half-updated): every such request not already finished finishes with finish_reason "error"
        (``result(id).error`` says why) and keeps the tokens it had received; the loop is dropped, so queued
        requests start a new one at the next step."""
        for request_id in [*self._rows, *extra]:
            result = self._requests[request_id].result
            if result.finish_reason is None:
                result.finish_reason, result.error = "error", f"{type(error).__name__}: {error}"
        self._rows, self._loop = [], None

    def _collect(self, loop: SpeculativeLoop, rows: list[int]) -> tuple[dict[int, list[int]], list[int]]:
        """After ``loop.step()``: the tokens row b emitted go to request ``rows[b]`` (stop strings cut them); a row
        whose verification emitted nothing (``loop.failed_rows``) finishes its request with finish_reason "error".
        Returns ({request_id: new tokens}, the requests that finished in this iteration)."""
        emitted, finished = loop.emitted(), loop.finished_host
        new: dict[int, list[int]] = {}
        done = []
        for row, request_id in enumerate(rows):
            request = self._requests[request_id]
            result = request.result
            result.iterations += 1
            result.drafted_tokens += loop.last_drafted[row]
            tokens = emitted[row]
            if tokens:
                result.token_ids.extend(tokens)
                stopped = None if request.stop is None else self._stopped_at(request, tokens)
                if stopped is not None:  # the tokens after the one completing a stop string are dropped
                    del result.token_ids[len(result.token_ids) - len(tokens) + stopped + 1:]
                    tokens = tokens[: stopped + 1]
                    result.finish_reason = "stop"
                    done.append(request_id)
                new[request_id] = list(tokens)
            # the accepted drafts it kept: the last token it received counts as the target's (as SpeculationStats)
            result.accepted_tokens += max(0, min(loop.last_accepted[row], len(tokens) - 1))
            if row in loop.failed_rows:  # its own logits left no token (e.g. every id suppressed, or NaN)
                result.finish_reason, result.error = "error", loop.failed_rows[row]
                done.append(request_id)
            elif finished[row] and result.finish_reason is None:
                hit_eos = bool(result.token_ids) and result.token_ids[-1] in request.eos
                result.finish_reason = "eos" if hit_eos else "length"
                done.append(request_id)
        return new, done

    def _admit(self) -> tuple[list[int], SpeculativeLoop] | None:
        """(the joining requests, their prefilled loop; stepped once when a loop runs, see ``_join``): the longest
        prefix of the queue, up to the free rows, whose loop can be built and, when a loop runs, take its first
        iteration (halved while out of memory). None when not even the first request's can: out of memory
        while rows run, it waits (retried at every step: rows that leave free their memory), as it does in a serving
        engine's FIFO scheduler; out of memory with no row running, or failing otherwise, it cannot run now, and it
        finishes with finish_reason "error" and the reason in ``RequestResult.error`` (the requests behind it go
        on). Out of memory beside a static loop left idle with no rows, that loop is freed first (before halving) and the
        joining requests build the running loop on their own."""
        count = min(self.max_batch_size - len(self._rows), len(self._queue))
        while True:
            joining = self._queue[:count]
            try:
                loop = self._build(joining)
                if self._loop is not None:
                    with torch.inference_mode():
                        loop.step()  # raises before any result changed
                return joining, loop
            except Exception as error:  # noqa: BLE001 -- out of memory: wait or halve; else the request's own failure
                if not is_out_of_memory(error):
                    if count > 1:
                        count = 1  # find out whether the first request alone fails
                        continue
                    self._fail(joining[0], error)
                    return None
                if self._loop is not None and not self._rows:  # an idle static loop keeps its allocation with no
                    self._loop = None  # rows: free it, and the joining requests build the running loop on their own
                    continue
                if count > 1:
                    count //= 2
                    continue
                if self._rows:
                    return None
                self._fail(joining[0], error)
                return None

    def _fail(self, request_id: int, error: Exception) -> None:
        """A queued request that cannot run: it leaves the queue with finish_reason "error" and the reason."""
        self._queue.remove(request_id)
        result = self._requests[request_id].result
        result.finish_reason, result.error = "error", f"{type(error).__name__}: {error}"

    def _join(self, loop: SpeculativeLoop, joining: list[int]) -> dict[int, list[int]]:
        """After the joining requests' first iteration on their own loop (``_admit``), its unfinished rows join the
        running loop; requests that finished in it (max_new_tokens=1, EOS, a stop string) never join. Should the
        merge fail midway (an allocation inside ``append_rows``), neither loop can go on: every running and
        joining request finishes with finish_reason "error" with its tokens so far (in ``result``) and the error
        propagates. A merge refused before the running loop changed (``JoinRefused``: e.g. a drafter's add_rows
        refusing, a static cache without room) and a failure on the joining loop alone end the joining requests
        only, with finish_reason "error" and the reason; the running ones go on, and their first tokens are
        returned."""
        del self._queue[: len(joining)]
        try:
            new, done = self._collect(loop, joining)
        except BaseException as error:  # (a stop-string check that raised, Ctrl-C) they left the queue: end them
            for request_id in joining:
                result = self._requests[request_id].result
                if result.finish_reason is None:
                    result.finish_reason, result.error = "error", f"{type(error).__name__}: {error}"
            raise
        remaining = [row for row, request_id in enumerate(joining) if request_id not in done]
        if not remaining:
            return new
        try:
            with torch.inference_mode():
                if len(remaining) < len(joining):
                    loop.keep_rows(remaining)  # (the joining loop's own rows: the running loop is untouched)
        except BaseException as error:
            self._end_joining(joining, remaining, error)
            if not isinstance(error, Exception):  # Ctrl-C
                raise
            return new
        try:
            with torch.inference_mode():
                self._loop.append_rows(loop)
        except JoinRefused as error:  # refused before the running loop changed: it goes on
            self._end_joining(joining, remaining, error)
            return new
        except BaseException as error:  # failed mid-merge (e.g. out of memory, Ctrl-C): neither loop can go on
            self._fail_running(error, extra=[joining[row] for row in remaining])
            raise
        else:
            self._rows = self._rows + [joining[row] for row in remaining]
        return new

    def _end_joining(self, joining: list[int], remaining: list[int], error: BaseException) -> None:
        """The joining requests still running (``joining[row]`` for ``row`` in ``remaining``) cannot join: they
        finish with finish_reason "error" and the reason, with the tokens of their first iteration."""
        for row in remaining:
            result = self._requests[joining[row]].result
            result.finish_reason, result.error = "error", f"{type(error).__name__}: {error}"

    def _leave(self, request_ids: list[int]) -> None:
        """Remove these running requests' rows from the loop (all rows: drop the loop, except on the static cache,
        whose loop keeps its allocation with no rows until requests join it, unless its drafter never started:
        rows could not join it)."""
        remaining = [row for row, r in enumerate(self._rows) if r not in request_ids]
        if not remaining and (self.static_rows is None or not self._loop.drafter_started):
            self._loop, self._rows = None, []
            return
        with torch.inference_mode():
            self._loop.keep_rows(remaining)
        self._rows = [self._rows[row] for row in remaining]

    def _build(self, ids: list[int]) -> SpeculativeLoop:
        """A loop over the new requests ``ids`` (their prompts left-padded, their own settings and keys),
        prefilled."""
        requests = [self._requests[r] for r in ids]
        prompts = [r.result.prompt_ids for r in requests]
        width = max(len(p) for p in prompts)
        pad = self._pad_id()
        device = model_device(self.decoder.target)
        input_ids = torch.full((len(ids), width), pad, dtype=torch.int64, device="cpu")  # (host; moved below)
        mask = torch.zeros_like(input_ids)
        for row, (prompt, request) in enumerate(zip(prompts, requests)):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.int64, device="cpu")
            mask[row, width - len(prompt):] = 1 if request.mask is None else torch.tensor(request.mask, device="cpu")
        rows = RowSettings(max_new_tokens=[r.max_new_tokens for r in requests], eos=[r.eos for r in requests],
                           temperature=[r.temperature for r in requests], top_k=[r.top_k for r in requests],
                           top_p=[r.top_p for r in requests], min_new_tokens=[r.min_new_tokens for r in requests],
                           keys=[r.key for r in requests], draft_offsets=[0] * len(ids), verify_offsets=[0] * len(ids),
                           processors=[r.processors for r in requests], warpers=[r.warpers for r in requests],
                           prompt_lengths=[len(p) for p in prompts])
        d = self.decoder
        chunks = [r.prefill_chunk_size for r in requests if r.prefill_chunk_size is not None]
        static = {}
        if self.static_rows is not None:  # the running loop's caches hold every row; a joining loop's, its own
            running = self._loop is None
            static = dict(cache_implementation="static", static_rows=self.static_rows if running else None)
            if self.compile_options is not None and running:  # the running loop's steps are captured
                static["compile_options"] = self.compile_options
            elif self.compile_options is not None:  # a joining loop runs its own rows eagerly
                static["joins_captured"] = True
        drafter = None if d.drafter is None else d.drafter()
        if drafter is not None and self._loop is not None and drafter is self._loop.drafter:
            raise ValueError(f"SpeculativeDecoder's drafter factory returned the {type(drafter).__name__} the running "
                             "batch already uses; each loop needs its own drafter: pass a factory that returns a "
                             "new one per call (drafter=lambda: MyDrafter(...))")
        with torch.inference_mode():
            return build_loop(
                d.target, d.draft, input_ids.to(device), attention_mask=mask.to(device),
                num_speculative_tokens=d.num_speculative_tokens, tokenizer=d.tokenizer,
                assistant_tokenizer=d.assistant_tokenizer, backend=d.backend,
                drafter=drafter, max_new_tokens=max(rows.max_new_tokens),
                prefill_chunk_size=min(chunks, default=None),
                do_sample=False, num_return_sequences=1, pad_token_id=pad, rows=rows, **static, **d.lookup,
                return_dict_in_generate=False)  # (tokens only: the model's own output defaults collect no scores)

    def _pad_id(self) -> int:
        config = self.decoder.target.generation_config
        for value in (config.pad_token_id, config.eos_token_id, 0):
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return 0
