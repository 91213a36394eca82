"""A decoder object a serving loop drives one iteration at a time.

    decoder = SpeculativeDecoder(target, draft, num_speculative_tokens=4)
    session = decoder.start(input_ids, attention_mask=mask, max_new_tokens=128, do_sample=True, temperature=0.7,
                            seed=1234)
    while not session.finished:
        for row, tokens in enumerate(session.step()):   # one draft+verify iteration, one host read
            send(row, tokens)
    sequences = session.sequences()

Without a draft model: ``SpeculativeDecoder(target, prompt_lookup_num_tokens=10)`` (prompt lookup),
``SpeculativeDecoder(target, assistant_early_exit=4)`` (the target's first 4 decoder layers draft), or
``SpeculativeDecoder(target, drafter=lambda: NGramDrafter(...))`` (a new ``Drafter`` per session).

``start`` takes ``generate``'s keyword arguments (``seed=`` included: the same seed, the same tokens). Each ``step``
returns the tokens every row emitted in that iteration (an empty list for a finished row); they come from the
iteration's single device-to-host read. For text, give each row a ``streaming.IncrementalDetokenizer``.

Continuous batching (requests joining and leaving between steps, each with its own settings and seed):

    a = decoder.add_request(prompt_ids, max_new_tokens=64, do_sample=True, temperature=0.7, seed=1)
    while decoder.has_work():
        for request_id, tokens in decoder.step().items():
            send(request_id, tokens)
    decoder.result(a)            # token_ids, finish_reason ("eos", "length", "stop", "cancelled"), statistics

The design, its cost and its admission bound: ``continuous.py``.
"""

import copy
import threading

import torch

from .continuous import ContinuousBatcher, RequestResult
from .generation.adapters import unwrap_adapters
from .generation.autocast_state import AutocastState
from .generation.capabilities import check_deterministic
from .generation.early_exit import early_exit_draft, requested_exit_layers
from .generation.inputs import check_helpers, check_models
from .generation.loop import SpeculativeLoop
from .generation.options import CompileOptions
from .generation.request import build_loop
from .generation.settings import check_lookup_gamma
from .generation.stats import SpeculationStats
from .generation.vocab import VocabBridge, tokenizers_differ


# generate's keywords that a SpeculativeDecoder holds for every session: start() refuses them by name
DECODER_ARGUMENTS = {"draft_model": "its draft argument", "assistant_model": "its draft argument",
                     "drafter": "drafter=", "num_speculative_tokens": "num_speculative_tokens=", "backend": "backend=",
                     "tokenizer": "tokenizer=, e.g. for stop_strings",
                     "assistant_tokenizer": "assistant_tokenizer=",
                     "assistant_early_exit": "assistant_early_exit="}


class DecodeSession:
    """One batch of requests in flight. Created by ``SpeculativeDecoder.start``."""

    def __init__(self, loop: SpeculativeLoop):
        self._loop = loop
        self.finished = loop.plan.max_new_tokens == 0
        self.iterations = 0
        self._failure: BaseException | None = None  # what a step raised: the loop's state is then half-updated
        self._stepping = False  # inside step(): a callback calling step() again is refused
        self._lock = threading.RLock()  # step(), sequences(), stats: another thread's call waits for a running step
        # the caller's autocast where start() prefilled the caches: every step runs under it, whatever thread steps
        self._autocast = AutocastState.current()

    @property
    def loop(self) -> SpeculativeLoop:
        """The loop this session drives, for inspection (its runners, buffers, the gamma of the last iteration)."""
        return self._loop

    def step(self) -> list[list[int]]:
        """Run one iteration; returns the new token ids of each row ([] for rows already finished). Should it raise
        (a stopping criterion, a streamer, a forward), the session's state is half-updated: later steps raise a
        RuntimeError saying so (``sequences()`` still returns what was written, which may include the failed
        iteration's tokens)."""
        with self._lock:
            return self._step()

    def _step(self) -> list[list[int]]:
        if self._failure is not None:
            raise RuntimeError(f"an earlier step() raised ({type(self._failure).__name__}: {self._failure}), leaving the "
                               "session's caches and buffers half-updated; start a new session") from self._failure
        if self.finished:
            raise RuntimeError("the session is finished; start a new one")
        if self._stepping:  # (a callback of this step: a stopping criterion, processor, streamer)
            raise RuntimeError("step() is already running (called from inside a step: a stopping criterion, logits "
                               "processor, prefix_allowed_tokens_fn or streamer); call it after the step returns")
        target = self._loop.target_runner.model
        if target.training:  # (put in training mode since start(): refused before anything runs, as start() refuses)
            check_deterministic(target)
        self._loop.check_before_step()
        self._stepping = True
        try:
            with torch.inference_mode(), self._autocast.entered():
                self.finished = not self._loop.step()
        except BaseException as error:  # (a stopping criterion, streamer or forward that raised mid-iteration)
            self._failure = error
            raise
        finally:
            self._stepping = False
        if self.finished:  # (a prompt cache passed to start(): extended as model.generate leaves it, at batch 1)
            with torch.no_grad():
                self._loop.extend_caller_cache(stacklevel=3)  # (step() -> the caller)
        self.iterations += 1
        self._loop.remind_past_positions()
        return self._loop.emitted()

    def sequences(self) -> torch.Tensor:
        """[B, L + new]: prompts and everything generated so far (finished rows padded); a copy, an ordinary tensor
        (the session's own buffers are inference tensors, which later steps overwrite)."""
        with self._lock:
            longest = int(self._loop.generated.max())
            return self._loop.sequences[:, : self._loop.prompt_length + longest].clone()

    @property
    def stats(self) -> SpeculationStats:
        """The session's statistics so far (phase times included; total_time_s is prefill plus the steps): a snapshot,
        which later steps leave as it is (subtract two to measure the steps between them)."""
        with self._lock:
            return copy.deepcopy(self._loop.update_stats())


class SpeculativeDecoder:
    """A target and what drafts for it, validated once, that starts decoding sessions.

    target, draft: HF causal LMs on one device sharing a vocabulary (see ``generate``); draft None with
    ``prompt_lookup_num_tokens`` (and ``max_matching_ngram_size``: prompt lookup, HF's names), ``assistant_early_exit``
    (an int N: the target's first N decoder layers, its final norm and LM head draft; ``generation/early_exit.py``)
    or ``drafter`` (a callable returning a fresh ``Drafter`` for each session). num_speculative_tokens: an int, or "auto" to calibrate
    gamma per session over its first iterations (``generation/gamma.py``), or None for ``generate``'s default
    (num_assistant_tokens where set, else 5; prompt_lookup_num_tokens with prompt lookup). max_batch_size: the most
    requests ``add_request`` runs at once (the others wait in a queue). cache_implementation: the caches of
    ``add_request``'s batch (``start()`` takes its own): None / "dynamic", or "static" with max_context (the most
    tokens, prompt plus max_new_tokens, of any request): K/V for max_batch_size rows of max_context (plus the
    documented slack) allocated, after a free-memory check, when the batch starts (``docs/batching.md``). compile:
    False, True or a ``CompileOptions`` (as ``generate``'s; ``start()`` takes its own): with the static cache, the
    running batch's target and
    draft steps are captured (CUDA graphs on a GPU) with automatic dynamic shapes (about three compilations per
    step, whatever max_batch_size is), warmed up at each new batch size before its first step; joining requests are
    prefilled and take their first step eagerly, on their own rows (``docs/batching.md``).
    """

    def __init__(self, target, draft=None, *, num_speculative_tokens: int | str | None = None, backend: str = "auto",
                 tokenizer=None, assistant_tokenizer=None, prompt_lookup_num_tokens: int | None = None,
                 max_matching_ngram_size: int | None = None, drafter=None, max_batch_size: int = 16,
                 cache_implementation: str | None = None, max_context: int | None = None, compile=False,
                 assistant_early_exit: int | None = None):
        given = [draft, prompt_lookup_num_tokens, drafter, assistant_early_exit]
        if sum(value is not None for value in given) > 1:
            raise ValueError("pass one of draft, prompt_lookup_num_tokens, assistant_early_exit or drafter")
        if drafter is not None and not callable(drafter):
            raise TypeError("drafter must be a callable returning a new Drafter for each session")
        # (a PEFT wrapper (LoRA, ...) runs the transformers model inside it: drive that one, generation/adapters.py)
        self.target, self.draft = unwrap_adapters(target, "target"), unwrap_adapters(draft, "draft")
        self._given = (target, draft)  # (read again at each start/add_request: _follow_target)
        self.exit_layers = None
        if assistant_early_exit is not None:  # (validated here, not by every request's first step)
            check_models(self.target, None, names=("target", "draft"), early_exit=True)
            self.exit_layers = requested_exit_layers(self.target, None, {"assistant_early_exit": assistant_early_exit},
                                                     drafting=False, lookup_given=False)
            self.draft = early_exit_draft(self.target, self.exit_layers)
        check_models(self.target, self.draft, names=("target", "draft"))  # not a model: refused here, by name
        check_helpers(tokenizer, assistant_tokenizer, None)
        # a draft of another tokenizer (re-tokenizing the text: ``retokenizing_drafter.py``), decided once
        self.draft_retokenizes = self.draft is not None and tokenizers_differ(tokenizer, assistant_tokenizer)
        if self.draft_retokenizes:
            # (a draft with another tokenizer: the dynamic cache only, refused here rather than by each request)
            what = ("with a draft model of another tokenizer (assistant_tokenizer= with another vocabulary than "
                    "tokenizer=)")
            if cache_implementation not in (None, "dynamic"):
                raise ValueError(f"cache_implementation={cache_implementation!r} is not supported {what}: its "
                                 "draft's cache grows by a varying number of tokens per iteration")
            if compile is not False and compile is not None:
                raise ValueError(f"compile is not supported {what}")
        elif self.draft is not None:  # a pair of two vocabularies: refused here, not by every request's first step
            VocabBridge(self.target, self.draft, tokenizer, assistant_tokenizer)
        self.drafter = drafter
        self.lookup = {name: value for name, value in (("prompt_lookup_num_tokens", prompt_lookup_num_tokens),
                                                       ("max_matching_ngram_size", max_matching_ngram_size))
                       if value is not None}
        check_lookup_gamma(num_speculative_tokens, prompt_lookup_num_tokens)  # (not at each request's first step)
        self.num_speculative_tokens = num_speculative_tokens
        self.backend = backend
        self.tokenizer, self.assistant_tokenizer = tokenizer, assistant_tokenizer
        self._batcher = ContinuousBatcher(self, max_batch_size, cache_implementation, max_context, compile)

    def start(self, input_ids: torch.Tensor, **generation_kwargs) -> DecodeSession:
        """Prefill both models for input_ids [B, L] and return the session to ``step``. generation_kwargs:
        ``generate``'s, ``seed`` and ``compile`` included (the session's own; the decoder's ``compile`` is
        ``add_request``'s batch), less those the decoder holds
        (``DECODER_ARGUMENTS``: tokenizer, num_speculative_tokens, ..., refused by name). A session yields token ids
        (``step``, ``sequences``): an output object, scores, logits or a streamer asked for (as keywords or in a
        ``generation_config`` passed here) are refused by name; the model's own generation_config defaults for them
        do not apply to a session. A prompt cache (``past_key_values``/``cache``, as ``generate`` takes it) is
        extended as ``generate`` extends it (batch 1; else a warning) by the step that finishes the session; a session
        that raised or is abandoned leaves it as it was."""
        for name in [*DECODER_ARGUMENTS, *self.lookup]:  # (they reached build_loop twice: "got multiple values")
            if name in generation_kwargs:
                raise ValueError(f"{name} is a setting of the decoder, not of start(): pass it to "
                                 f"SpeculativeDecoder(...) ({DECODER_ARGUMENTS.get(name, f'{name}=')})")
        config = generation_kwargs.get("generation_config")
        if getattr(config, "assistant_early_exit", None) is not None:  # (else: "pass either ... or draft_model")
            raise ValueError("assistant_early_exit (in generation_config) is a setting of the decoder, not of start(): "
                             "pass it to SpeculativeDecoder(...) (assistant_early_exit=)")
        for name in ("streamer", "return_dict_in_generate", "output_scores", "output_logits"):
            if generation_kwargs.get(name) or getattr(config, name, None):
                where = "" if generation_kwargs.get(name) else " (in generation_config)"
                raise ValueError(f"{name}{where} is not available on a session; read the tokens from step() (for "
                                 "text, give each row an IncrementalDetokenizer)")
        if config is None:  # (the model's own return_dict_in_generate would have the loop collect scores for nothing)
            generation_kwargs["return_dict_in_generate"] = False
        if "compile" in generation_kwargs:  # generate's argument (the decoder's own compile= is add_request's batch)
            generation_kwargs["compile_options"] = CompileOptions.from_argument(generation_kwargs.pop("compile"))
        self._follow_target()
        with torch.inference_mode():
            loop = build_loop(
                self.target, self.draft, input_ids, num_speculative_tokens=self.num_speculative_tokens,
                tokenizer=self.tokenizer, assistant_tokenizer=self.assistant_tokenizer, backend=self.backend,
                drafter=None if self.drafter is None else self.drafter(), **self.lookup, **generation_kwargs,
            )
        return DecodeSession(loop)

    # ------------------------------------------------------------------------------- continuous batching
    def add_request(self, prompt_ids, **kwargs) -> int:
        """Queue a request; it joins the running batch at the next ``step`` (prefilled within it). prompt_ids: a
        1-D integer tensor (or one row, [1, n], as a tokenizer returns it) or a list of ints. kwargs (the target's
        generation config gives the defaults, as in ``generate``): max_new_tokens, do_sample, temperature, top_k, top_p,
        seed (None: one drawn from torch's default generator), eos_token_id, min_new_tokens, stop_strings (needs
        ``tokenizer=`` on the decoder; matched after every token as HF's StopStringCriteria; an explicit None turns
        off the model's, as in ``model.generate``), prefill_chunk_size
        (requests admitted together are prefilled in chunks of the smallest given). Anything else is refused by name.
        Returns its request id."""
        self._follow_target()  # (a running batch goes on with its own draft; the request's rows join its runner)
        return self._batcher.add_request(prompt_ids, **kwargs)

    def _follow_target(self) -> None:
        """The models as they are now. A PEFT wrapper's adapters are read again (``unwrap_adapters``): one switched
        to since the decoder was made (set_adapter, leaving disable_adapter()) is refused as ``generate`` refuses it,
        and a generation_config set on the wrapper since is handed over as its generate does. With
        assistant_early_exit: the draft view of the target as it is now (a head replaced, the embeddings resized,
        set_attn_implementation, train()/eval() since the decoder was made: early_exit_draft builds a new view for
        those, the same object otherwise)."""
        for role, given, driven in (("target", self._given[0], self.target), ("draft", self._given[1], self.draft)):
            if given is not None and unwrap_adapters(given, role) is not driven:
                raise ValueError(f"the {role}'s PEFT wrapper holds another model than when the decoder was made "
                                 "(merge_and_unload, an adapter of another kind set); make a new SpeculativeDecoder")
        if self.exit_layers is not None:
            self.draft = early_exit_draft(self.target, self.exit_layers)

    def step(self) -> dict[int, list[int]]:
        """Admit queued requests (up to max_batch_size running) and return their first tokens (their prefill and
        first iteration on their rows alone; the running rows emit at the next step), or else run one iteration of
        the running batch; returns {request_id: new token ids} for every request that produced tokens. Finished
        requests leave the batch at once. A request out of memory waits while others run; one that cannot be admitted
        at all finishes with finish_reason "error" (``result(id).error`` says why). A step that raises midway (e.g.
        out of memory in a forward) ends every running request with finish_reason "error" and the tokens it had
        received, and re-raises; queued requests start a new batch at the next step."""
        return self._batcher.step()

    def cancel(self, request_id: int) -> bool:
        """Stop a queued or running request, freeing its row; False if it had already finished."""
        return self._batcher.cancel(request_id)

    def result(self, request_id: int) -> RequestResult:
        """A snapshot of a request: its generated token ids, finish_reason (None while running) and statistics."""
        return self._batcher.result(request_id)

    def release(self, request_id: int) -> None:
        """Forget a finished request's result."""
        self._batcher.release(request_id)

    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return self._batcher.has_work()

    @property
    def running(self) -> list[int]:
        """Ids of the running requests, in row order."""
        return self._batcher.running

    @property
    def queued(self) -> list[int]:
        """Ids of the requests waiting to join."""
        return self._batcher.queued
