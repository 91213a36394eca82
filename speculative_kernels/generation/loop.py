"""The speculative decoding loop (Leviathan et al. 2023, Algorithm 1): one ``step`` drafts, verifies, emits and
rolls back for every row at once, with one device-to-host read (the iteration's flags, tokens and the lengths the
runners asked for). The walk-through of an iteration is in ``docs/architecture.md``."""

import dataclasses
import itertools
import time
from collections.abc import Callable
from types import ModuleType

import torch

from ..ops.diagnostics import raise_for_invalid_rows
from ..ops.randomness import DecodeRandomness
from ..ops.sampling import GREEDY
from ..ops.warping import warp_logits
from .buffers import initial_new_tokens, widen
from .context_processors import RowProcessors, RowWarpers, Warpers
from .decode_experts import DecodeExperts
from .draft_processors import DraftProcessors
from .drafter import Drafter, check_drafter, reads_emitted_tokens
from .proposal import (check_choose_logits, check_lengths_to_read, check_proposal, check_proposal_counts,
                       describe_bad_proposal, flag_proposal)
from .gamma import GammaCalibrator
from .logit_masks import LogitMasks
from .memory import check_free_memory
from .options import BatchingOptions
from .prompt_cache import extend_caller_cache
from .row_settings import RowSettings
from .rows import Outputs, RowDropper
from .runners import Runner
from .runners.captured import check_no_global_hooks
from .runners.prefill import prefill, prefill_forwards, prompt_real
from .settings import Plan, remind_past_positions
from .stats import PhaseTimer, SpeculationStats
from .stop_strings import completes_stop_string
from .transfer import host_to_device


class JoinRefused(ValueError):
    """``SpeculativeLoop.append_rows`` refused the other loop's rows before changing this loop's."""


class SpeculativeLoop:
    """Runs one batch of prompts to completion (``run``), or one iteration at a time (``step``, for a server).

    Built complete by ``request.build_loop``. target: the target model's ``Runner``; drafter: what proposes the
    tokens (``drafter.py``); input_ids, attention_mask: [B, L], the (decoder) prompts, left-padded; vocab: V of the
    target's logits; dtype: the verification's dtype (the target's); impl: the module implementing ``verify``/``sample``
    (``ops.backends.implementation``); batching: when finished rows leave the batch in ``run``; warm_up: called after
    the prefill, returns its seconds (``compile=True``: captures and warms up the steps); seed: the run's random
    numbers (``DecodeRandomness``; None: drawn from torch's default generator); rows: per-row settings of a batch
    of separate requests (``row_settings.py``: each row's length limit, EOS ids, sampling parameters, key and
    offsets), replacing the plan's for every row; the plan's ``max_new_tokens`` must be their largest. processors:
    HF's logits processors per row (``context_processors.py``), which then replace ``LogitMasks`` on the target's
    logits (HF's list holds the minimum length and the forced tokens, in HF's order), processed in float32. The
    draft's logits get the lists' bans (``draft_processors.py``: an n-gram ban, suppressed tokens, ...), so that the
    draft does not propose what the target bans; q stays what it samples from. warpers: HF's sampling
    warper chain (``Plan.warping``: a warper the ops lack, e.g. min_p), run on target and draft logits before the ops,
    whose own warping is then neutral. decode_experts: the models' decode-time experts implementation
    (``decode_experts.py``: what ``model.generate`` switches an MoE model to after its prefill), entered for the
    iterations that verify drafts, never for the prefills; ``run`` holds it until the end, ``step`` leaves the models
    as they were after each iteration. caller_cache: (the argument's name, the caller's DynamicCache) of a prompt
    cache (``prompt_cache.py``), extended after the last step by ``extend_caller_cache``. first_token_from_prompt: the
    target's first token comes from its forward over the whole prompt, as model.generate's does, rather than from a
    verification over [the prompt's last token, drafts]: for a target whose forward over the prompt's last token
    differs from its forward over later ones (``ModelSpec.bounded_step_size``: Mamba2 mixers clamp dt in the prompt's
    scan only). prompt_remainder_first: the target's prompt chunks (``prefill_chunk_size``) run the short one first
    (``ModelSpec.prompt_remainder_first``, ``runners.prefill``).

    Every row drafts at most its own tokens left, less one (``ops.verify``'s ``num_draft_tokens``), and its
    random-number offsets count its own draws, so a row's output does not depend on its batch-mates.
    """

    def __init__(self, target: Runner, drafter: Drafter, plan: Plan, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, *, vocab: int, dtype: torch.dtype, impl: ModuleType,
                 batching: BatchingOptions = BatchingOptions(), warm_up: Callable[[], float] | None = None,
                 seed: int | None = None, rows: RowSettings | None = None,
                 processors: RowProcessors | None = None, warpers: Warpers | None = None, stop=None,
                 decode_experts: DecodeExperts | None = None, timer: PhaseTimer | None = None,
                 caller_cache: tuple | None = None, first_token_from_prompt: bool = False,
                 prompt_remainder_first: bool = False):
        check_drafter(drafter)  # (before the prefill: a factory or a class passed for the instance)
        if (processors is not None or warpers is not None) and rows is not None:
            raise ValueError("a batch of requests (rows=) takes each row's processors and warpers from its "
                             "RowSettings")
        self.target_runner, self.drafter, self.plan = target, drafter, plan
        # Our own drafters' ids and logits are valid by construction (read on the exact class: a subclass, which may
        # override propose, is checked as a user's drafter)
        self._trusted_drafter = bool(type(drafter).__dict__.get("PROPOSES_VALID_IDS", False))
        self._hands_emitted = reads_emitted_tokens(drafter)  # (Drafter.emitted_read: the read's host tokens)
        self.processors, self.warpers = processors, warpers
        # stop: HF's StopStringCriteria (``stop_strings``), checked per row after every emitted token on a host
        # copy of the row's tokens (prompt rows read once here; the new tokens are the iterations' reads).
        self.stop = stop
        self._host_rows = input_ids.tolist() if stop is not None else None
        # Where each row's own tokens start in ``sequences`` (what its processors read): 0 for one call's batch
        # (HF's processors see its left padding); for a batch of requests, after the padding of the batch.
        self._context_start = [0] * input_ids.shape[0]
        if rows is not None:
            if rows.processors is not None and any(rows.processors):
                self.processors = RowProcessors(rows.processors)
            if rows.warpers is not None and any(w is not None for w in rows.warpers):
                self.warpers = RowWarpers(rows.warpers)
            if rows.prompt_lengths is not None:
                self._context_start = [input_ids.shape[1] - n for n in rows.prompt_lengths]
        self.impl, self.batching, self.vocab, self._dtype = impl, batching, vocab, dtype
        self.device = input_ids.device
        self.batch, self.prompt_length = input_ids.shape
        # The prompt's first tokens the target's runner holds already (a caller's prompt cache, ``prompt_cache.py``):
        # the target's prefill forwards the rest only, as model.generate does
        self.prompt_cached = target.num_slots
        self.caller_cache = caller_cache
        self._first_token_from_prompt = first_token_from_prompt
        self._prompt_remainder_first = prompt_remainder_first
        # num_speculative_tokens="auto": start at the calibration gamma, choose after a few iterations (gamma.py);
        # buffers are sized for the largest gamma it may choose.
        self.calibrator = GammaCalibrator(max_gamma=plan.max_gamma) if plan.num_speculative_tokens == "auto" else None
        self.chosen_gamma = self.calibrator.start_gamma if self.calibrator else plan.num_speculative_tokens
        self.gamma = self.chosen_gamma  # this iteration's: chosen_gamma, capped by the tokens left (_step_gamma)
        self.max_gamma = plan.max_gamma
        self._largest_gamma_used = self.gamma
        if rows is not None and (rows.batch != self.batch or max(rows.max_new_tokens) != plan.max_new_tokens):
            raise ValueError(f"rows must have {self.batch} entries whose largest max_new_tokens is the plan's "
                             f"({plan.max_new_tokens})")
        self.per_row = rows is not None  # a batch of separate requests: rows may join (``append_rows``)
        self._captured = warm_up is not None
        self.sampling = plan.sampling if rows is None else rows.sampling(self.device)
        # A batch of requests: which rows are greedy (host facts). While every row is, the iterations run the
        # greedy ops (``_sampling_now``): the same tokens as the sampling ops give greedy rows, without their sort
        # of every row's logits (top-k/top-p) and per-row draws.
        self._greedy_rows = None if rows is None else [t == 0.0 for t in rows.temperature]
        self._max_new = [plan.max_new_tokens] * self.batch if rows is None else list(rows.max_new_tokens)
        self.sequences_fill = plan.pad_token_id if plan.pad_token_id is not None else 0
        width = self._buffer_width(self.prompt_length + initial_new_tokens(plan.max_new_tokens))
        self._check_memory(width)
        self.sequences = torch.full((self.batch, width), self.sequences_fill, dtype=torch.int64, device=self.device)
        self.sequences[:, : self.prompt_length] = input_ids
        # Each row's new tokens so far and whether it finished live on the host, updated from the iterations' reads
        # (the EOS and length cuts are host work on the tokens read); the device copies (``generated``,
        # ``finished``) are made when something needs them.
        self._generated_host = [0] * self.batch
        self._finished_host = [0] * self.batch
        self._generated_device: torch.Tensor | None = None
        self._finished_device: torch.Tensor | None = None
        self.eos = frozenset(plan.eos_token_ids or ())
        self._eos = [self.eos] * self.batch if rows is None else [frozenset(e) for e in rows.eos]
        self.masks = LogitMasks(plan, self.prompt_length, vocab, self.device, rows)
        if rows is None and self.sampling.greedy:  # nothing is random: draw no seed (torch's generator untouched,
            keys = torch.zeros(self.batch, dtype=torch.int64, device=self.device)  # as in model.generate)
            self.randomness = DecodeRandomness(self.batch, self.device, keys=keys)
        elif rows is None:
            self.randomness = DecodeRandomness(self.batch, self.device, seed)
        else:
            keys = host_to_device(rows.keys, torch.int64, self.device)
            self.randomness = DecodeRandomness(self.batch, self.device, keys=keys,
                                               offsets=(rows.draft_offsets, rows.verify_offsets))
        self._draft_advances = 0  # draft offsets advanced in this iteration (a drafter with a model: gamma)
        self._draft_processors: DraftProcessors | None = None  # this iteration's (``_draft``), or None
        self.last_accepted: list[int] = []  # per row, the drafts it accepted in the last step (-1: finished)
        self.last_drafted: list[int] = []  # per row, the tokens it was drafted in the last step (0: finished)
        self.failed_rows: dict[int, str] = {}  # per_row: rows whose last step emitted nothing, and why
        self.iteration = 0
        self.stats = SpeculationStats(num_speculative_tokens=self.gamma, accepted_histogram=[0] * (self.gamma + 1))
        self._histogram = [0] * (self.max_gamma + 1)
        self._offsets: dict[int, torch.Tensor] = {}  # T -> arange(T) [1, T] on the device
        self.timer = timer if timer is not None else PhaseTimer(self.device)  # (build_loop's holds the encoder's)
        self.scores = self._score_buffer() if plan.output_scores else None
        self.raw_logits = self._score_buffer() if plan.output_logits else None
        self._started = time.monotonic()  # (max_time counts from here, as HF's MaxTimeCriteria from its prefill)
        self._decode_experts = decode_experts or DecodeExperts(())
        self._hold_decode_experts = False  # run(): stay switched between iterations
        self._prefill(input_ids, attention_mask)
        if warm_up is not None:  # it captures the decode steps: in the setting they will run in
            self._decode_experts.enter()
            try:
                self.stats.warmup_time_s = warm_up()
            finally:
                self._decode_experts.exit()

    # ----------------------------------------------------------------------------------------------- state
    @property
    def generated(self) -> torch.Tensor:
        """[B] int64 on the device: new tokens per row so far (made from the host counts when asked for)."""
        if self._generated_device is None:
            self._generated_device = host_to_device(self._generated_host, torch.int64, self.device)
        return self._generated_device

    @generated.setter
    def generated(self, value: torch.Tensor) -> None:
        self._set_generated(value.tolist())

    def _set_generated(self, counts: list[int]) -> None:
        self._generated_host, self._generated_device = list(counts), None

    @property
    def finished(self) -> torch.Tensor:
        """[B] bool on the device: rows that finished (made from the host flags when they change)."""
        if self._finished_device is None:
            self._finished_device = host_to_device(self._finished_host, torch.bool, self.device)
        return self._finished_device

    @finished.setter
    def finished(self, value: torch.Tensor) -> None:
        self._set_finished([int(f) for f in value.tolist()])

    @property
    def finished_host(self) -> list[int]:
        """[B] host flags (1: finished), as of the last iteration's read."""
        return list(self._finished_host)

    def _set_finished(self, flags: list[int]) -> None:
        if flags != self._finished_host:
            self._finished_host, self._finished_device = list(flags), None

    def _positions(self, width: int) -> torch.Tensor:
        """arange(width) [1, width] on the device, made once per width."""
        offsets = self._offsets.get(width)
        if offsets is None:
            offsets = self._offsets[width] = torch.arange(width, device=self.device).unsqueeze(0)
        return offsets

    # ----------------------------------------------------------------------------------------------- set-up
    def _buffer_width(self, length: int) -> int:
        """Output-buffer width for sequences of ``length`` tokens: the slack of one iteration's scatter (gamma + 1
        positions past the last token), never more than the whole request needs."""
        return min(length, self.prompt_length + self.plan.max_new_tokens) + self.max_gamma + 1

    def _check_memory(self, width: int) -> None:
        """MemoryError before allocating output buffers of ``width`` columns that the device cannot hold."""
        per_column = 8 + 4 * self.vocab * (int(self.plan.output_scores) + int(self.plan.output_logits))
        required = {"sequences": self.batch * width * 8,
                    "scores": self.batch * width * (per_column - 8)}
        required["total"] = sum(required.values())
        check_free_memory(required, self.device, f"the output buffers ({self.batch} rows x {width} tokens)")

    def _reserve(self, length: int) -> None:
        """Make the output buffers hold sequences of ``length`` tokens (host int), doubling their width."""
        if length + self.max_gamma + 1 <= self.sequences.shape[1]:
            return
        width = self._buffer_width(max(length, 2 * (self.sequences.shape[1] - self.max_gamma - 1)))
        self._check_memory(width)
        self.sequences = widen(self.sequences, width, self.sequences_fill)
        new_width = width - self.prompt_length
        if self.scores is not None:
            self.scores = widen(self.scores, new_width, 0.0)
        if self.raw_logits is not None:
            self.raw_logits = widen(self.raw_logits, new_width, 0.0)

    def _score_buffer(self):
        # (float32, as HF's scores, whatever torch's default dtype)
        return torch.zeros(self.batch, self.sequences.shape[1] - self.prompt_length, self.vocab, dtype=torch.float32,
                           device=self.device)

    def _step_gamma(self) -> int:
        """This iteration's gamma: the chosen one, but never more than the most tokens an unfinished row still has
        to generate, less one (HF caps the same way); 0 when one token is left."""
        if self._prompt is not None:  # the first token comes from the target's forward over the prompts
            return 0
        left = max((m - g for m, g, f in zip(self._max_new, self._generated_host, self._finished_host)
                    if not f), default=1)
        chosen = self.chosen_gamma
        if self.calibrator is not None and self.calibrator.probe_due:  # "auto" paused: a probe of the drafts
            chosen = self.calibrator.resume_gamma
        gamma = max(0, min(chosen, left - 1))
        proposals = self._proposal_counts()  # a drafter without a model: no longer than its longest proposal
        if proposals is not None:
            gamma = min(gamma, max((c for c, f in zip(proposals, self._finished_host) if not f), default=0))
        return gamma

    def _proposal_counts(self) -> list[int] | None:
        """The drafter's ``proposal_counts()``, checked (B host ints >= 0, or None)."""
        return check_proposal_counts(self.drafter, self.drafter.proposal_counts(), self.batch)

    @property
    def _all_greedy_rows(self) -> bool:
        """A batch of requests whose rows are all greedy (host facts)."""
        return self._greedy_rows is not None and all(self._greedy_rows)

    @property
    def _sampling_now(self):
        """This iteration's ``Sampling``: the loop's own, or plain greedy while every row of a batch of requests is
        greedy (their per-row parameters are then temperature 0 throughout, so nothing drawn or warped differs; no
        random-number counter advances, and greedy rows read none)."""
        return GREEDY if self._all_greedy_rows else self.sampling

    def _draft_limits(self) -> torch.Tensor | None:
        """Each row's draft limit this iteration: gamma, but never more than its own tokens left less one, so a row
        is drafted as many tokens as it would be alone. Returns [B] int64 on the device, or None when every
        unfinished row takes all gamma (the common case: no tensor, no op), and when every row is greedy (a draft
        past a row's end cannot change its tokens, which the host cuts at its length)."""
        if self._sampling_now.greedy:
            return None
        limits = [self.gamma if f else max(0, min(self.gamma, m - g - 1))
                  for m, g, f in zip(self._max_new, self._generated_host, self._finished_host)]
        if self.gamma == 0 or min(limits) == self.gamma:
            return None
        return host_to_device(limits, torch.int64, self.device)

    def _prefill(self, input_ids, attention_mask) -> None:
        """max_new_tokens=1: nothing will be drafted, the one step runs the target on the prompts. A greedy batch of
        separate requests (``rows``; ``SpeculativeDecoder.add_request``) takes its first token from the target's
        forward over the whole prompts too (a step with nothing drafted), so a joining request's first token comes
        from its prefill, as in ``model.generate``; only the draft is prefilled here. (Sampled rows keep the
        drafted first iteration: their random numbers are those of the request alone.)"""
        real = attention_mask.to(torch.bool)
        self._all_real = bool(real.all())  # (read here, at setup: an unpadded prompt's forwards get no 4-D mask)
        self._prompt = None
        self._drafter_started = False
        first_from_prompt = (self._all_greedy_rows and not self._captured) or self._first_token_from_prompt
        if self.plan.max_new_tokens == 1 or first_from_prompt:
            self._prompt = (input_ids[:, self.prompt_cached:], real[:, self.prompt_cached:])
            self.last = input_ids[:, -1:]
            if self.plan.max_new_tokens > 1:
                self.timer.start("prefill")
                self.drafter.start(input_ids, real)
                self.timer.stop("prefill")
                self._drafter_started = True
            return
        self._prefill_models(input_ids, real)

    def _prefill_models(self, input_ids, real) -> None:
        """The target (and the drafter, unless already started) condition on the prompts [B, L] but their last
        tokens (real [B, L] bool); the target forwards those past ``prompt_cached``."""
        start_drafter, self._drafter_started = not self._drafter_started, True
        cached = self.prompt_cached
        if self.prompt_length > 1:
            self.timer.start("prefill")
            if self.prompt_length - 1 > cached:
                prefill(self.target_runner, input_ids[:, cached:-1], prompt_real(real[:, cached:-1], self._all_real),
                        self.plan.prefill_chunk_size, self._prompt_remainder_first)
                self.stats.prefill_forwards += prefill_forwards(self.prompt_length - 1 - cached,
                                                                self.plan.prefill_chunk_size)
            if start_drafter:
                self.drafter.start(input_ids, real)
            self.timer.stop("prefill")
        elif start_drafter:
            self.drafter.start(input_ids, real)
        self.last = input_ids[:, -1:]  # [B, 1]: each row's last token, the target's next input

    # ----------------------------------------------------------------------------------------------- steps
    def _choose_draft_token(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        """The drafter's ``choose``: draft logits [B, V] of draft position i masked in place as the target's are
        (``LogitMasks``), then the token [B] drawn from them."""
        if not self._trusted_drafter:
            check_choose_logits(self.drafter, logits, i, batch=self.batch, vocab=self.vocab, device=self.device)
        if self.masks.active:
            self.masks.apply(logits.unsqueeze(1), (self.generated + i).unsqueeze(1))
        if self._draft_processors is not None:  # HF's common processors, as the target's position i (in place)
            self._draft_processors.process(logits, i)
        if self.warpers is not None:  # q is what the draft samples from: the warped logits, stored in place
            logits.copy_(self.warpers(logits.float()))
        if self._sampling_now.greedy:
            # The backends' greedy sample is argmax over float32 (first index on ties); an invalid row (NaN, all
            # -inf) is still caught: verify checks the stored draft logits.
            token = logits.float().argmax(dim=-1)
        else:
            token = self.impl.sample(logits, self.sampling, self.randomness.draft())
            self.randomness.advance_draft()
            self._draft_advances += 1
            # An invalid row's -1 becomes a valid id to feed; verify flags the row from its stored draft logits.
            token = token.clamp_(min=0)
        if self._draft_processors is not None:
            self._draft_processors.drafted(token, i)
        return token

    def _contexts(self, rows: list[int]) -> list:
        """Row b's tokens so far, [1, prompt + generated] (None for rows not in ``rows``)."""
        contexts = [None] * self.batch
        for b in rows:
            end = self.prompt_length + self._generated_host[b]
            contexts[b] = self.sequences[b : b + 1, self._context_start[b] : end]
        return contexts

    def _unfinished(self) -> list[int]:
        return [b for b, f in enumerate(self._finished_host) if not f]

    def _verify(self, draft_tokens, draft_logits, num_draft):
        """The target's forward over [last, drafts] and ``verify``. num_draft: [B] int64, each row's proposals (the
        rest are fillers, never accepted), or None (all gamma). Returns (out [B, gamma + 1]: the emitted tokens then
        -1, accepted [B] or None when gamma is 0, the processed target logits, the raw ones or None)."""
        s = self._sampling_now
        self._processor_caps = {}  # row -> the drafts it may verify, where its processors raised (``process``)
        self._capping = None  # [B] int64: each row's drafts to verify (gamma + 1: all), where processors ran
        if self._prompt is not None:  # one forward over the whole prompt, as model.generate (see ``_prefill``)
            (prompt, real), self._prompt = self._prompt, None  # (or one per chunk: the last gives the token)
            real = prompt_real(real, self._all_real)
            logits = prefill(self.target_runner, prompt, real, self.plan.prefill_chunk_size,
                             self._prompt_remainder_first)
            self.stats.prefill_forwards += prefill_forwards(prompt.shape[1], self.plan.prefill_chunk_size) - 1
        else:
            target_in = torch.cat([self.last, draft_tokens], dim=1) if self.gamma else self.last
            logits = self.target_runner.forward(target_in)
        raw = logits.clone() if self.raw_logits is not None else None
        # With HF's processors the target's EOS-before-min_new_tokens is their MinNewTokensLength's; the draft's
        # logits are masked by ``masks`` either way (q is what the draft samples from). A batch of separate requests
        # (per_row) masks every row: on a row with processors that sets the EOS entries to -inf before HF's
        # processors set them to -inf again, which changes nothing (those before MinNewTokensLength in HF's list
        # act on each entry alone).
        if self.masks.active and (self.processors is None or self.per_row):
            self.masks.apply(logits, self.generated.unsqueeze(1) + self._positions(self.gamma + 1))
        if self.processors is not None:  # HF's list (holding the masks' processors too), on float32 logits as HF
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()  # (the runner's: a graph's?)
            rows = self._unfinished()
            self._processor_caps = self.processors.process(logits, self._contexts(rows), draft_tokens, rows)
            if self.gamma:
                # Rows whose processors raised at position j, or left it without a distribution (every logit
                # -inf; a NaN or +inf, e.g. a sequence bias of +inf after a draft that HF's processors ban): the
                # context there holds j drafts, one model.generate may never build (a draft to be
                # rejected; a row past its own end beside rows with more left). Each verifies j drafts (gamma + 1
                # for the others: never reached), and a token drawn at j is dropped (``_drop_unprocessed_tokens``).
                # Position 0, the row's real context, is what model.generate processes: it fails there as HF would.
                caps = self._dead_positions(logits)
                if self._processor_caps:
                    raised = [self._processor_caps.get(b, self.gamma + 1) for b in range(self.batch)]
                    caps = torch.minimum(caps, host_to_device(raised, torch.int64, self.device))
                self._capping = caps
                capped = caps.clamp(max=self.gamma)
                num_draft = capped if num_draft is None else torch.minimum(num_draft, capped)
        if self.warpers is not None and not self.plan.processors_warp:  # (else the rows' lists held the warpers)
            logits = self.warpers(logits.float())
        self.stats.target_forwards += 1
        if self.gamma == 0:  # nothing drafted: one token from the target alone
            if s.greedy:
                return self.impl.sample(logits[:, 0], s, self.randomness.draft()).unsqueeze(1), None, logits, raw
            # Sampled: verify with no proposal (num_draft_tokens 0), so the token is drawn exactly as a row of a
            # batch with no tokens of its own to draft draws it (ops.verify's n_b = 0 stream, at the row's verify
            # offset): a request's last token does not depend on whether it has batch-mates.
            none = torch.zeros(self.batch, 1, dtype=torch.int64, device=self.device)
            out, _ = self.impl.verify(torch.cat([logits, logits], dim=1), None, none, s, self.randomness.verify(),
                                      num_draft_tokens=none[:, 0])
            self.randomness.advance_verify()
            return out[:, :1], None, logits, raw
        # q as it was drawn from (None: one-hot at the drafts): a drafter's float32 q is not rounded to a bfloat16
        # target's dtype, which would verify another q than the one sampled (the op takes mixed dtypes). Greedy
        # verification does not read q (a draft is accepted iff it is the target's argmax): not passed, so a draft
        # whose logits overflow (inf/NaN in half precision) still drafts, as in HF's greedy assisted generation.
        q_logits = None if s.greedy else draft_logits
        # num_draft [B] int64 (or None: all gamma): rows that proposed fewer tokens (prompt lookup without a long
        # match) carry fillers past num_draft[b], which the verification never accepts: such a row emits the
        # target's own token at num_draft[b] (from p there when it accepted every proposal, else the residual).
        out, accepted = self.impl.verify(logits, q_logits, draft_tokens, s, self.randomness.verify(),
                                         num_draft_tokens=num_draft)
        if self._capping is not None:
            out, accepted = self._drop_unprocessed_tokens(out, accepted, self._capping)
        if self._proposal is not None:  # rows whose proposal was invalid: flagged as the op flags invalid rows
            bad = self._proposal[3]
            out, accepted = out.masked_fill(bad.unsqueeze(1), -1), accepted.masked_fill(bad, -1)
        if not s.greedy:
            self.randomness.advance_verify()
        return out, accepted, logits, raw

    def _dead_positions(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, gamma + 1, V] float32 as processed -> [B] int64: each row's first position j >= 1 without a
        distribution (no admissible token: every logit -inf; or a NaN or +inf, which the verification also flags),
        gamma + 1 where none; those positions get finite logits (0) in place, so that a token drawn there (dropped
        after) never flags the row invalid. Device ops, no host read."""
        dead = ~torch.isfinite(logits[:, 1:].amax(dim=-1))  # [B, gamma] (amax: NaN with any NaN, +inf with any)
        first = torch.where(dead.any(dim=1), dead.to(torch.int64).argmax(dim=1) + 1, self.gamma + 1)
        logits[:, 1:].masked_fill_(dead.unsqueeze(-1), 0.0)
        return first

    def _drop_unprocessed_tokens(self, out: torch.Tensor, accepted: torch.Tensor, caps: torch.Tensor):
        """A row whose processors raised at position j (``RowProcessors.process``) verified its first j drafts;
        where it accepted all j, the token after them was drawn from position j, which is unprocessed: it is
        dropped, and the row's last accepted draft becomes the token it emits (its slot is rolled back and run
        again next iteration, whose position 0 processes that context as ``model.generate`` would, raising
        there if it raises). A rejection before j emits as usual. Exact: every emitted token comes from a
        processed position, and the dropped one is drawn next iteration from the same distribution.
        out [B, gamma + 1], accepted [B], caps [B] (j, or gamma + 1 for a row whose processors did not raise) ->
        out and accepted, fixed (device ops, no host read)."""
        full = accepted == caps
        position = caps.clamp(max=self.gamma).unsqueeze(1)
        out = out.scatter(1, position, torch.where(full.unsqueeze(1), -1, out.gather(1, position)))
        self._dropped = full.long()  # (read with the iteration's tokens: alpha counts those j accepted drafts)
        return out, accepted - self._dropped

    def _cut(self, tokens: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Host side of emitting: tokens [B * (gamma + 1)] as read (each row's emitted tokens, then -1). Returns
        (accepted n per row, -1 for an invalid row; count per row after the EOS and max_new_tokens cuts, 0 for a
        finished row; the finished flags after this iteration)."""
        width = self.gamma + 1
        accepted, counts, finished = [], [], []
        for b in range(self.batch):
            max_new, eos = self._max_new[b], self._eos[b]
            row = tokens[b * width : (b + 1) * width]
            emitted = row.index(-1) if -1 in row else width
            accepted.append(emitted - 1)
            if self._finished_host[b]:
                counts.append(0)
                finished.append(1)
                continue
            count = min(emitted, max_new - self._generated_host[b])
            hit = next((j for j in range(count) if row[j] in eos), None)
            if hit is not None:
                count = hit + 1
            counts.append(count)
            finished.append(int(hit is not None or self._generated_host[b] + count >= max_new))
        return accepted, counts, finished

    def _write(self, out: torch.Tensor, counts: list[int]) -> None:
        """Write each row's first counts[b] tokens of out [B, gamma + 1] after its tokens so far."""
        if self.batch == 1:
            if counts[0]:
                start = self.prompt_length + self._generated_host[0]
                self.sequences[:, start : start + counts[0]] = out[:, : counts[0]]
            return
        width = out.shape[1]
        index = [[self.prompt_length + g + j for j in range(width)] for g in self._generated_host]
        keep = [[int(j < c) for j in range(width)] for c in counts]
        index, keep = host_to_device([index, keep], torch.int64, self.device)
        current = self.sequences.gather(1, index)
        self.sequences.scatter_(1, index, torch.where(keep.bool(), out, current))

    def _store_scores(self, processed, raw, counts: list[int], generated_before: list[int]) -> None:
        """Per emitted token: HF's ``scores`` (warped target logits) and ``logits`` (raw)."""
        positions = self._positions(self.gamma + 1)
        count = host_to_device(counts, torch.int64, self.device)
        before = host_to_device(generated_before, torch.int64, self.device)
        index = (before.unsqueeze(1) + positions).unsqueeze(-1).expand(-1, -1, processed.shape[-1])
        keep = (positions < count.unsqueeze(1)).unsqueeze(-1)
        for buffer, values in ((self.scores, processed), (self.raw_logits, raw)):
            if buffer is None:
                continue
            if buffer is self.scores and not self.sampling.greedy:
                values = warp_logits(values, self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)
            if buffer is self.scores and self.plan.renormalize_logits:  # HF's LogitNormalization, last
                values = torch.log_softmax(values.float(), dim=-1)
            buffer.scatter_(1, index, torch.where(keep, values.float(), buffer.gather(1, index)))

    def _draft(self):
        """gamma draft tokens per row. Returns (tokens [B, gamma] int64, q's logits [B, gamma, V] or None,
        num_draft [B] int64 or None: the drafter's per-row counts)."""
        self._proposal = None  # (tokens, logits, num_draft, bad rows) of a proposal whose values are checked
        self._draft_processors = None
        if self.gamma == 0:
            return None, None, None
        if self.processors is not None:  # (``draft_processors.py``: which processors, and why)
            rows = self._unfinished()
            self._draft_processors = DraftProcessors.start(self.processors.stages, self._contexts(rows), rows,
                                                           self.gamma, self.device)
        tokens, logits, num_draft = self.drafter.propose(self.gamma, self._choose_draft_token)
        check_proposal(self.drafter, tokens, logits, num_draft, batch=self.batch, gamma=self.gamma,
                       vocab=self.vocab, device=self.device)
        if not self._trusted_drafter:  # a user's drafter, the n-gram drafter
            s = self._sampling_now
            temperature = None if s.greedy else s.rows.safe_temperature() if s.per_row else s.temperature
            greedy_rows = s.rows.greedy if s.per_row else None  # (q is checked on sampled rows only)
            safe, bad = flag_proposal(tokens, logits, num_draft, self.vocab, temperature, greedy_rows)
            # (described after ``observe``, which may refill the drafter's buffers: a copy of what it proposed)
            self._proposal = (tokens.clone(), logits, None if num_draft is None else num_draft.clone(), bad)
            tokens = safe
        self.stats.draft_forwards = self.drafter.forwards
        return tokens, logits, num_draft

    def _roll_back(self, out, accepted, draft_tokens, accepted_host: list[int]) -> None:
        """Both caches keep what was accepted; finished rows keep no new slots, so no row outgrows prompt +
        max_new_tokens. out [B, gamma + 1]: the emitted tokens; accepted [B]."""
        kept_host = [0 if f else n + 1 for n, f in zip(accepted_host, self._finished_host)]
        kept = host_to_device(kept_host, torch.int64, self.device)
        self.target_runner.keep_prefix(self.gamma + 1, kept, max(kept_host), kept_host)
        if min(accepted_host) == max(accepted_host):  # every row's next input is at the same column: a view
            self.last = out[:, accepted_host[0] : accepted_host[0] + 1]
        else:
            self.last = out.gather(1, accepted.unsqueeze(1))
        if self.gamma > 0:  # gamma 0 (a drafter without a model proposed nothing): the drafter has nothing to undo
            self.drafter.accept(draft_tokens, accepted, accepted_host, self.last[:, 0], self.finished)

    def step(self) -> bool:
        """One draft + verify iteration for every unfinished row. Returns True while any row is unfinished.

        Afterwards ``emitted()`` lists the token ids each row emitted (read in the iteration's one host read).
        """
        if self._prompt is None:  # an iteration over the prompts is the prefill: HF's switch exempts it
            self._decode_experts.enter()
        try:
            return self._step()
        finally:
            if not self._hold_decode_experts:
                self._decode_experts.exit()

    def check_before_step(self) -> None:
        """Raise, with nothing changed, what a step would refuse now: with captured steps (compile=True), a global
        module forward hook registered since (``runners.check_no_global_hooks``). A server calls it before a step,
        so that the refusal ends no request."""
        if self._captured:
            check_no_global_hooks()

    def _step(self) -> bool:
        self.check_before_step()
        self.timer.start("step")
        self.gamma = self._step_gamma()
        self._largest_gamma_used = max(self._largest_gamma_used, self.gamma)  # (a paused "auto"'s probe)
        self._reserve(self.prompt_length + max(self._generated_host) + 1)
        self.timer.start("draft")
        proposals = self._proposal_counts()
        limits = self._draft_limits()
        self._draft_advances = 0
        draft_tokens, draft_logits, num_draft = self._draft()
        # The drafter's per-row counts, when the host does not know them (its first iteration, after rows left or
        # joined, a compiled prompt lookup, a drafter of one's own): read with the iteration's tokens, for the
        # statistics (the fillers past them are not drafted tokens).
        read_drafted = num_draft is not None and proposals is None
        if read_drafted:  # (a copy: the read comes after ``observe``, where a drafter may refill its buffers)
            num_draft = num_draft.clone()
        if limits is not None:  # rows near their end verify only their own drafts
            num_draft = limits if num_draft is None else torch.minimum(num_draft, limits)
        # A row that drafted fewer tokens than gamma (its own count, its tokens-left limit) keeps the draft offsets
        # of its fillers when every draft was drawn through ``choose``: its offsets count its own drafts, as alone
        # (where gamma is its own count), not the batch's largest. (Filler draws are never verified: reusing their
        # offsets next iteration is exact.)
        if num_draft is not None and self._draft_advances == self.gamma:
            self.randomness.give_back_draft(self.gamma - num_draft.clamp(0, self.gamma))
        self.timer.stop("draft")
        self.timer.start("verify")
        out, accepted, processed, raw = self._verify(draft_tokens, draft_logits, num_draft)
        # A drafter may prepare its next proposal now, so that its counts ride along in the read below.
        # (max_new_tokens=1: the drafter was never started, and nothing follows this iteration)
        drafting = (self.target_runner, self.drafter) if self._drafter_started else (self.target_runner,)
        if self._drafter_started:
            # A row that emitted nothing (an invalid proposal or verification: out all -1, accepted -1) is passed
            # as finished with accepted 0, as it is treated after the read (it fails, or raises), so observe never
            # sees -1 (device ops, no read)
            invalid = out[:, 0] < 0
            self.drafter.observe(out, None if accepted is None else accepted.clamp(min=0), self.finished | invalid)
        # The one device-to-host read of the iteration: the emitted tokens (the accepted counts are where the -1
        # padding starts); the runners' and the drafter's lengths (hole compaction, capacity bounds, proposal
        # counts) ride along.
        readers = [(r, r.lengths_to_read()) for r in drafting]
        readers = [(r, lengths) for r, lengths in readers if lengths is not None]
        for reader, lengths in readers:  # (a drafter's: checked before the cat, which would promote the token ids)
            if reader is self.drafter:
                check_lengths_to_read(self.drafter, lengths, self.device)
        # (rows whose processors raised: whether the token after their capped drafts was dropped, for alpha)
        dropped = [self._dropped, self._capping] if self._capping is not None else []
        if readers or read_drafted or dropped:
            host = torch.cat([out.flatten(), *(lengths for _, lengths in readers),
                              *([num_draft] if read_drafted else []), *dropped]).tolist()
        else:
            host = out.flatten().tolist()
        self.timer.stop("verify")
        b, tail = self.batch, out.numel()
        tokens_host = host[:tail]
        accepted_host, count_host, finished_host = self._cut(tokens_host)
        self.failed_rows = {}
        if min(accepted_host) < 0:
            if accepted is None:
                accepted = host_to_device(accepted_host, torch.int64, self.device)
            inputs = dict(target_logits=processed, draft_logits=draft_logits, draft_tokens=draft_tokens)
            if not self.per_row:  # one request: it fails, naming the rows
                rows = [row for row, n in enumerate(accepted_host) if n < 0]
                reason = self._bad_proposal_reason(rows[0])
                if reason is not None:
                    raise ValueError(f"{reason} (batch rows {rows})")
                try:
                    raise_for_invalid_rows(accepted, temperature=self.sampling.temperature, **inputs)
                except ValueError as error:  # (the op's argument names, as the caller knows the tensors)
                    raise ValueError(self._named_inputs(str(error))) from None
            # A batch of separate requests: the invalid rows (a request whose own settings leave no token, NaN
            # logits on its row) finish here with nothing emitted and the reason in ``failed_rows``; the others go
            # on as if those rows had been finished before this iteration.
            for row, n in enumerate(accepted_host):  # (not b: the batch size, read below)
                if n < 0 and not self._finished_host[row]:
                    self.failed_rows[row] = self._invalid_row_reason(row, accepted, inputs)
                    accepted_host[row], count_host[row], finished_host[row] = 0, 0, 1
            accepted = accepted.clamp(min=0)
        for reader, lengths in readers:
            reader.lengths_read(host[tail : tail + lengths.numel()])
            tail += lengths.numel()
        drafted_host = host[tail : tail + b] if read_drafted else proposals
        tail += b if read_drafted else 0
        # alpha's passed tests: a row whose token after its j capped drafts was dropped accepted all j of them
        passed_host = [n + d for n, d in zip(accepted_host, host[tail : tail + b])] if dropped else accepted_host
        if dropped:  # each row's drafts verified (``_verify``'s caps), for the drafted counts
            self._processor_caps = {row: c for row, c in enumerate(host[tail + b : tail + 2 * b]) if c <= self.gamma}
        active_host = [0 if b in self.failed_rows else 1 - f for b, f in enumerate(self._finished_host)]
        generated_before = self._generated_host
        self._write(out, count_host)
        self._set_generated([g + c for g, c in zip(generated_before, count_host)])
        self._set_finished(finished_host)
        if self.masks.active:  # the draft's masks read it: made now, while the device is idle, not mid-draft
            self._generated_device = host_to_device(self._generated_host, torch.int64, self.device)
        self._host_tokens, self._host_counts, self._host_width = tokens_host, count_host, self.gamma + 1
        self.last_accepted = [n if a else -1 for n, a in zip(accepted_host, active_host)]
        if self.scores is not None or self.raw_logits is not None:
            self._store_scores(processed, raw, count_host, generated_before)
        stopped = self._after_emit(count_host, accepted_host, passed_host, active_host, generated_before,
                                   drafted_host)
        if stopped or self._out_of_time():
            self._set_finished([1] * b)  # a stopping criterion ended the (batch-1) request, or max_time passed
        if self._hands_emitted and self._drafter_started:  # (the host copy above: no read of its own)
            self.drafter.emitted_read(self.emitted(), self.finished_host)
        # No rollback when nothing runs after; gamma 0 mid-run (a drafter without a model proposed nothing) still
        # moves each row's next input to its new token.
        if not all(self._finished_host):
            self._roll_back(out, accepted, draft_tokens, accepted_host)
        # (while "auto" is paused every iteration is observed: the plain ones count towards the next probe)
        if self.calibrator is not None and (self.gamma == self.chosen_gamma or self.calibrator.paused):
            active = [i for i, a in enumerate(active_host) if a]
            self._calibrate([min(passed_host[i], self.last_drafted[i]) for i in active],
                            [self.last_drafted[i] for i in active])
        self.iteration += 1
        self.timer.stop("step")
        return not all(self._finished_host)

    def _bad_proposal_reason(self, b: int) -> str | None:
        """Why row b's proposal was flagged (``proposal.py``), or None (not flagged, or a trusted drafter)."""
        if self._proposal is None:
            return None
        tokens, logits, num_draft, bad = self._proposal
        if not bool(bad[b]):
            return None
        return describe_bad_proposal(self.drafter, tokens, logits, num_draft, self.vocab, b)

    def _named_inputs(self, message: str, row: int | None = None) -> str:
        """The verification's diagnostic with its inputs named as the caller knows them: the target's logits (said
        to be processed where HF's processors or warpers ran on them: of batch row ``row``, or of any row), and the
        drafter's (the draft model's, for a draft model) instead of target_logits / draft_logits."""
        model = getattr(getattr(self.drafter, "runner", None), "model", None)
        # (after HF's processors or warpers, the values checked are theirs: a NaN may come from them, e.g. 5.17's
        # exponential_decay_length_penalty over min_new_tokens' -inf, with the model's own logits finite)
        processed = (" after the logits processors and warpers of the settings"
                     if self._processed(row) else "")
        names = {"draft_logits": f"draft_logits, the {'draft model' if model is not None else 'drafter'}'s logits "
                                 f"({type(model if model is not None else self.drafter).__name__}),",
                 "target_logits": f"target_logits, the target's logits ({type(self.target_runner.model).__name__})"
                                  f"{processed},"}
        name = message.split(" ", 1)[0]
        return names[name] + message[len(name):] if name in names else message

    def _processed(self, row: int | None) -> bool:
        """Whether the target's logits of batch row ``row`` (None: any row) go through processors or warpers before
        the verification (the call's HF list, or a request's own)."""
        if self.plan.context_processing or self.plan.warping:
            return True
        rows = range(self.batch) if row is None else [row]
        processors, warpers = (getattr(lists, "rows", None) for lists in (self.processors, self.warpers))
        return any((processors is not None and bool(processors[b])) or (warpers is not None and warpers[b] is not None)
                   for b in rows)

    def _invalid_row_reason(self, b: int, accepted: torch.Tensor, inputs: dict) -> str:
        """Why row b's verification emitted nothing (``raise_for_invalid_rows`` on that row alone), without the
        batch row it names."""
        reason = self._bad_proposal_reason(b)
        if reason is not None:
            return f"ValueError: {reason}"
        sampling = None
        if self.sampling.per_row:
            sampling = dataclasses.replace(self.sampling, rows=self.sampling.rows.select(
                torch.tensor([b], device=self.device)))
        row = {name: None if tensor is None else tensor[b : b + 1] for name, tensor in inputs.items()}
        try:
            raise_for_invalid_rows(accepted[b : b + 1], temperature=self.sampling.temperature, sampling=sampling, **row)
        except ValueError as error:
            return "ValueError: " + self._named_inputs(str(error).replace(" in batch rows [0]", ""), b)
        return "ValueError: the verification emitted no token"

    def _out_of_time(self) -> bool:
        """max_time: True once max_time seconds have passed since the prefill began (every row then stops after
        this iteration, as HF's MaxTimeCriteria stops every row after its step)."""
        return self.plan.max_time is not None and time.monotonic() - self._started > self.plan.max_time

    def _calibrate(self, accepted_counts: list[int], drafted: list[int]) -> None:
        """num_speculative_tokens="auto": feed this iteration to the calibrator (per active row, the drafts it
        accepted of the ones it was drafted); switch gamma once it has chosen, and whenever its re-estimate of alpha
        (``GammaCalibrator.observe``) picks another.
        The phase times are complete here but for the verify phase's end event, recorded after the iteration's
        host read: ``timer.last`` waits for it (it is reached at once, the stream is idle there)."""
        if self.calibrator.done:  # re-estimating alpha from the counts alone (no timer read)
            chosen = self.calibrator.observe(accepted_counts, drafted)
        else:
            chosen = self.calibrator.record(accepted_counts, self.timer.last("draft"), self.timer.last("verify"),
                                            drafted=drafted)
        if chosen is not None:
            self.chosen_gamma = self.stats.num_speculative_tokens = chosen
            self._largest_gamma_used = max(self._largest_gamma_used, chosen)

    def histogram(self) -> list[int]:
        """accepted_histogram: [n] = row-steps (a row in one target forward) that kept n drafts, n in 0..largest
        gamma (see ``SpeculationStats``)."""
        return self._histogram[: self._largest_gamma_used + 1]

    def emitted(self) -> list[list[int]]:
        """Token ids each row emitted in the last ``step()`` (after EOS / length / stopping-criteria cuts)."""
        width = self._host_width
        tokens, counts = self._host_tokens, self._host_counts
        return [tokens[row * width : row * width + counts[row]] for row in range(self.batch)]

    def _after_emit(self, count_host, accepted_host, passed_host, active_host, generated_before,
                    drafted_host) -> bool:
        """Host-side bookkeeping that needs the counts: stopping criteria, streamer, stats. Returns True when a
        stopping criterion fired (the host's finished flags, read before it ran, are then stale). drafted_host: the
        drafter's per-row counts of this iteration (host), or None for gamma each."""
        stopped = False
        if self.stop is not None:
            self._apply_stop_strings(count_host, generated_before)
            count_host = self._host_counts
        if self.plan.stopping_criteria:
            stopped = self._apply_stopping_criteria(count_host, generated_before)
            count_host = self._host_counts
        self._count_drafts(count_host, accepted_host, passed_host, active_host, generated_before, drafted_host)
        self.stats.new_tokens += sum(count_host)  # (after the cuts of stop strings and stopping criteria)
        if self.plan.streamer is not None and count_host[0] > 0:
            start = self.prompt_length + generated_before[0]
            self.plan.streamer.put(self.sequences[:, start : start + count_host[0]].to("cpu", copy=True))
        return stopped

    def _count_drafts(self, count_host, accepted_host, passed_host, active_host, generated_before,
                      drafted_host) -> None:
        """The iteration's drafted / accepted counts (``SpeculationStats``), per active row: drafted d = its
        proposal (the drafter's count, else gamma), at most its own tokens left less one, as a sampled row's
        verification is limited (``_draft_limits``; a greedy row is not, but its drafts past its end could not be
        emitted); the accept tests of the drafts it accepted up to d; kept = the drafts among the tokens it emitted
        after every cut (EOS, length, stop strings, stopping criteria), its last emitted token counted as the
        target's: min(accepted, emitted - 1), which also places the row-step in the histogram."""
        drafted = []
        for i, a in enumerate(active_host):
            limit = max(0, min(self.gamma, self._max_new[i] - generated_before[i] - 1))
            limit = min(limit, self._processor_caps.get(i, limit))  # (a row processed up to j verified j)
            drafted.append(min(limit, drafted_host[i]) * a if drafted_host is not None else limit * a)
        self.last_drafted = drafted
        for i, a in enumerate(active_host):
            if not a:
                continue
            n, d = accepted_host[i], drafted[i]
            tested = min(passed_host[i], d)  # alpha's tests: every accepted draft passed one; a rejection (n < d) failed one
            self.stats.accept_tests_passed += tested
            self.stats.accept_tests += tested + int(tested < d)
            kept = max(0, min(n, count_host[i] - 1))
            self.stats.accepted_tokens += kept
            self._histogram[kept] += 1
        self.stats.drafted_tokens += sum(drafted)

    def _apply_stop_strings(self, count_host, generated_before) -> None:
        """``stop_strings``, per row, after every emitted token as HF checks them: a row whose new token completes a
        stop string keeps it, drops the tokens after it and finishes. Runs on the host copies of the rows (no device
        read: the emitted tokens are this iteration's read)."""
        counts, finished = list(count_host), list(self._finished_host)
        width, stopped = self._host_width, False
        for b, count in enumerate(count_host):
            row = self._host_rows[b]
            new = self._host_tokens[b * width : b * width + count]
            for j, token in enumerate(new):
                row.append(token)
                if completes_stop_string(self.stop, row):
                    counts[b], finished[b], stopped = j + 1, 1, True
                    break
        if not stopped:
            return
        for b, (before, kept) in enumerate(zip(count_host, counts)):
            if kept < before:  # the tokens after the stop were written: fill them as a finished row's
                start = self.prompt_length + generated_before[b]
                self.sequences[b, start + kept : start + before] = self.sequences_fill
                for steps in (self.scores, self.raw_logits):  # (and their steps: zeros, as a finished row's)
                    if steps is not None:
                        steps[b, generated_before[b] + kept : generated_before[b] + before] = 0
        self._set_generated([g + c for g, c in zip(generated_before, counts)])
        self._host_counts = counts
        self._set_finished(finished)

    def _apply_stopping_criteria(self, count_host, generated_before) -> bool:
        """User stopping criteria, evaluated after every emitted token as HF does (batch 1), with HF's arguments:
        the sequence so far and ``scores``, the tuple of every step's scores [1, V] so far where HF collects them
        (return_dict_in_generate with output_scores), else None. Returns whether one fired; then the tokens after
        it are cut and every row is finished."""
        start = self.prompt_length + generated_before[0]
        steps = None  # every step's scores [1, V] up to this iteration's last, made once per iteration
        if self.scores is not None and self.plan.return_dict_in_generate:
            steps = tuple(self.scores[:, s] for s in range(generated_before[0] + count_host[0]))
        for j in range(count_host[0]):
            ids = self.sequences[:, : start + j + 1]
            scores = None if steps is None else steps[: generated_before[0] + j + 1]
            if any(criterion_fired(c, ids, scores) for c in self.plan.stopping_criteria):
                self.sequences[:, start + j + 1 : start + count_host[0]] = self.plan.pad_token_id or 0
                self._set_generated([generated_before[0] + j + 1])
                self._host_counts = [j + 1]
                self._set_finished([1] * self.batch)
                return True
        return False

    def run(self):
        """Generate until every row finished. Returns (sequences [B, L + new], SpeculationStats)."""
        if self.plan.streamer is not None:
            self.plan.streamer.put(self.sequences[:, : self.prompt_length].to("cpu", copy=True))
        self.timer.start("total")
        running = self.plan.max_new_tokens > 0
        dropper = RowDropper(self.batching, self.sequences_fill)
        self._hold_decode_experts = True  # switched once, as model.generate does, not per iteration
        try:
            while running:
                running = self.step()
                if running and dropper.due(self._finished_host):
                    self._drop_finished_rows(dropper)
        finally:
            self._hold_decode_experts = False
            self._decode_experts.exit()
        full = dropper.finish(self._outputs())
        if full is not None:  # every row back, in its original place
            self.batch = full.generated.shape[0]
            self._set_outputs(full)
            self._set_finished([1] * self.batch)
        self.stats.dropped_rows = dropper.dropped
        self.timer.stop("total")
        if self.plan.streamer is not None:
            self.plan.streamer.end()
        longest = max(self._generated_host, default=0)
        self.remind_past_positions()
        self.update_stats()
        self.stats.total_time_s = self.timer.seconds("total") + self.timer.seconds("prefill")
        return self.sequences[:, : self.prompt_length + longest], self.stats

    def extend_caller_cache(self, stacklevel: int = 2):
        """After the last step: the caller's prompt cache extended as model.generate leaves it
        (``prompt_cache.extend_caller_cache``; batch 1, else a warning from the caller's ``stacklevel``). Returns the
        cache object when extended, else None."""
        if self.caller_cache is None:
            return None
        name, cache = self.caller_cache
        end = self.prompt_length + max(self._generated_host, default=0) - 1
        extended = extend_caller_cache(name, cache, self.target_runner.cache, self.batch, self.prompt_cached, end,
                                       stacklevel=stacklevel + 1)
        return cache if extended else None

    def remind_past_positions(self) -> None:
        """model.generate's reminder, where the sequences so far have grown past the target's
        max_position_embeddings before max_length (``settings.remind_past_positions``; run() and a DecodeSession's
        steps call it)."""
        remind_past_positions(self.plan, self.prompt_length, max(self._generated_host, default=0))

    def _drop_finished_rows(self, dropper: RowDropper) -> None:
        """Keep only the unfinished rows in every per-row state: outputs, flags, keys, runners (the row choice is
        made on the device from the finished flags; the host flags say how many remain)."""
        remaining = [i for i, f in enumerate(self._finished_host) if not f]
        keep = host_to_device(remaining, torch.int64, self.device)  # unfinished rows, in order
        outputs = dropper.drop(self._outputs(), keep)
        self.sequences, self.scores, self.raw_logits = outputs.sequences, outputs.scores, outputs.raw_logits
        self._select_row_state(remaining, keep)

    def keep_rows(self, remaining: list[int]) -> None:
        """Between steps: only rows ``remaining`` (host indices, in order) stay in the batch; the others' cache rows
        and outputs are freed (``SpeculativeDecoder``: finished and cancelled requests leave). With none left the
        loop keeps its allocations and waits for rows to join (``append_rows``; a static batch that falls idle);
        it cannot step before."""
        if sorted(set(remaining)) != list(remaining) or (remaining and remaining[-1] >= self.batch):
            raise ValueError(f"remaining must be increasing row indices in [0, {self.batch}), got {remaining}")
        keep = host_to_device(remaining, torch.int64, self.device)
        outputs = self._outputs().select(keep)
        self.sequences, self.scores, self.raw_logits = outputs.sequences, outputs.scores, outputs.raw_logits
        self._select_row_state(remaining, keep)

    def _select_row_state(self, remaining: list[int], keep: torch.Tensor) -> None:
        """Everything per row but the outputs: counts, flags, limits, EOS ids, sampling, keys, runners, drafter."""
        self._set_generated([self._generated_host[i] for i in remaining])
        self._set_finished([self._finished_host[i] for i in remaining])
        self._max_new = [self._max_new[i] for i in remaining]
        self._eos = [self._eos[i] for i in remaining]
        self.masks.select_rows(keep)
        if self._host_rows is not None:
            self._host_rows = [self._host_rows[i] for i in remaining]
        self._context_start = [self._context_start[i] for i in remaining]
        for per_row in (self.processors, self.warpers):
            if per_row is not None:
                per_row.select_rows(remaining)
        if self._greedy_rows is not None:
            self._greedy_rows = [self._greedy_rows[i] for i in remaining]
        if self.sampling.per_row:
            self.sampling = dataclasses.replace(self.sampling, rows=self.sampling.rows.select(keep))
        self.last = self.last.index_select(0, keep)
        self.randomness.select_rows(keep)
        self.target_runner.select_rows(keep)
        if self._drafter_started:  # (a loop whose rows all had one token to make never started its drafter)
            self.drafter.select_rows(keep)
        self.batch = len(remaining)

    @property
    def drafter_started(self) -> bool:
        """Whether the drafter has been started (it is not in a loop whose rows had one token each to make);
        ``append_rows`` needs it started on both sides."""
        return self._drafter_started

    def append_rows(self, other: "SpeculativeLoop") -> None:
        """Between steps: append the rows of ``other`` after this loop's rows, the counterpart of ``keep_rows``.

        ``other``: a loop over the same models and drafter kind, built by ``request.build_loop`` with per-row settings
        (``RowSettings``) and prefilled on its own rows only (requests joining a running batch); it is consumed.
        Every row keeps its prompt, tokens so far, length limit, EOS ids, sampling parameters, key, offsets and
        cache slots (``Runner.add_rows``, ``Drafter.add_rows``: the side with fewer slots gets holes on the left),
        so no row is forwarded again and each computes what it would alone.

        Raises ``JoinRefused`` (a ValueError), with this loop's rows unchanged, when the two loops cannot share a
        batch: this loop's checks, the target runner's (``check_add_rows``) and the drafter's own ``add_rows``
        (which is called before anything else changes: a drafter refuses by raising ValueError or
        NotImplementedError there). Anything raised after that (an allocation) leaves both loops half-joined:
        neither can go on."""
        try:
            self._check_joinable(other)
        except ValueError as error:
            raise JoinRefused(str(error)) from error
        for loop in (self, other):  # max_new_tokens=1 loops deferred their prefill: a shared step needs it done
            if loop._prompt is not None:
                (prompt, real), loop._prompt = loop._prompt, None
                loop._prefill_models(prompt, real)
        try:
            self.target_runner.check_add_rows(other.target_runner)
            # first of the changes: it checks its own settings, and a user's drafter refuses here
            self.drafter.add_rows(other.drafter)
        except (ValueError, NotImplementedError) as error:
            raise JoinRefused(f"cannot append these rows: {error}") from error
        prompt_length = max(self.prompt_length, other.prompt_length)
        outputs = self._joined_outputs(other, prompt_length)
        self.masks.add_rows(other.masks, self.batch, other.batch)
        self._join_processors(other)
        self._context_start = ([s + prompt_length - self.prompt_length for s in self._context_start]
                               + [s + prompt_length - other.prompt_length for s in other._context_start])
        sampling = dataclasses.replace(self.sampling, rows=self.sampling.rows.join(other.sampling.rows))
        self.target_runner.add_rows(other.target_runner)
        self.randomness.add_rows(other.randomness)
        self.sampling, self.last = sampling, torch.cat([self.last, other.last])
        self._greedy_rows = self._greedy_rows + other._greedy_rows
        self.sequences, self.scores, self.raw_logits = outputs.sequences, outputs.scores, outputs.raw_logits
        self.prompt_length = prompt_length
        self.plan = dataclasses.replace(self.plan, max_new_tokens=max(self.plan.max_new_tokens,
                                                                      other.plan.max_new_tokens))
        self._set_generated(self._generated_host + other._generated_host)
        self._set_finished(self._finished_host + other._finished_host)
        self._max_new, self._eos = self._max_new + other._max_new, self._eos + other._eos
        # ``other`` may have run iterations of its own (a joining request's first one): its rows keep their values
        self.last_accepted = (self.last_accepted or [-1] * self.batch) + (other.last_accepted or [-1] * other.batch)
        self.last_drafted = (self.last_drafted or [0] * self.batch) + (other.last_drafted or [0] * other.batch)
        self._grow_gamma(other)
        self._histogram = [a + b for a, b in itertools.zip_longest(self._histogram, other._histogram, fillvalue=0)]
        for name in ("prefill_forwards", "target_forwards", "drafted_tokens", "accepted_tokens", "new_tokens",
                     "accept_tests", "accept_tests_passed"):
            setattr(self.stats, name, getattr(self.stats, name) + getattr(other.stats, name))
        self._largest_gamma_used = max(self._largest_gamma_used, other._largest_gamma_used)
        self.timer.merge(other.timer)
        self.batch += other.batch
        self._host_tokens, self._host_counts, self._host_width = [-1] * self.batch, [0] * self.batch, 1

    @property
    def _gamma_setting(self):
        """num_speculative_tokens as the requests set it (build_loop caps the plan's at what the rows can draft)."""
        return self.plan.gamma_setting if self.plan.gamma_setting is not None else self.plan.num_speculative_tokens

    def _grow_gamma(self, other: "SpeculativeLoop") -> None:
        """Joining rows that may draft more than this loop's rows (a fixed gamma capped by their max_new_tokens,
        ``build_loop``): size this loop for theirs (the output buffers' slack follows ``max_gamma`` at the next
        ``_reserve``; the runners keep the larger reserve, ``SlotMaskRunner.add_rows``)."""
        if other.max_gamma <= self.max_gamma:
            return
        self.max_gamma = other.max_gamma
        self.plan = dataclasses.replace(self.plan, num_speculative_tokens=other.plan.num_speculative_tokens)
        if self.calibrator is None:
            self.chosen_gamma = self.stats.num_speculative_tokens = other.chosen_gamma

    def _check_joinable(self, other: "SpeculativeLoop") -> None:
        """ValueError unless ``other``'s rows can join this loop's batch (see ``append_rows``)."""
        if not isinstance(other, SpeculativeLoop) or other is self:
            raise ValueError("append_rows takes another SpeculativeLoop")
        why = None
        if not (self.per_row and other.per_row):
            why = "both loops must be built with per-row settings (rows=RowSettings)"
        elif other._captured:
            why = "the rows of a loop with captured steps (compile=True) cannot move to another loop"
        elif (self.device, self.vocab, self._dtype, self.impl) != (other.device, other.vocab, other._dtype,
                                                                    other.impl):
            why = "the loops differ in device, vocabulary, dtype or backend"
        elif (self._gamma_setting, self.plan.output_scores, self.plan.output_logits) != \
                (other._gamma_setting, other.plan.output_scores, other.plan.output_logits):
            why = "the loops differ in num_speculative_tokens or output_scores/output_logits"
        elif any(p.stopping_criteria or p.streamer is not None for p in (self.plan, other.plan)):
            why = "stopping criteria and streamers belong to a single request"
        elif self.masks.forced or other.masks.forced:
            why = "forced tokens (forced_bos/eos_token_id) are set per batch, not per row"
        elif type(self.target_runner) is not type(other.target_runner) or \
                self.target_runner.model is not other.target_runner.model or \
                type(self.drafter) is not type(other.drafter):
            why = "the loops must run the same target model and the same kind of drafter"
        elif not callable(getattr(self.drafter, "add_rows", None)):
            why = f"the drafter ({type(self.drafter).__name__}) has no add_rows"
        if why is not None:
            raise ValueError(f"cannot append these rows: {why}")

    def _join_processors(self, other: "SpeculativeLoop") -> None:
        """Each side's per-row processors and warpers, then the other's (a side without: rows with none)."""
        for name, make in (("processors", lambda n: RowProcessors([[] for _ in range(n)])),
                           ("warpers", lambda n: RowWarpers([None] * n))):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None and theirs is None:
                continue
            joined = mine if mine is not None else make(self.batch)
            joined.add_rows(theirs if theirs is not None else make(other.batch))
            setattr(self, name, joined)

    def _joined_outputs(self, other: "SpeculativeLoop", prompt_length: int) -> Outputs:
        """The output buffers of this loop's rows then ``other``'s, each side's prompts left-padded to
        ``prompt_length`` (sequences [B + B2, W], scores / raw logits [B + B2, W - prompt_length, V])."""
        new = max(loop.sequences.shape[1] - loop.prompt_length for loop in (self, other))
        sequences = []
        for loop in (self, other):
            pad = prompt_length - loop.prompt_length
            padded = torch.nn.functional.pad(loop.sequences, (pad, 0), value=self.sequences_fill)
            sequences.append(widen(padded, prompt_length + new, self.sequences_fill))
        scores = [None if self.scores is None else torch.cat([widen(loop.scores, new, 0.0) for loop in (self, other)]),
                  None if self.raw_logits is None else
                  torch.cat([widen(loop.raw_logits, new, 0.0) for loop in (self, other)])]
        return Outputs(torch.cat(sequences), None, *scores)

    def _outputs(self) -> Outputs:
        return Outputs(self.sequences, self.generated, self.scores, self.raw_logits)

    def _set_outputs(self, outputs: Outputs) -> None:
        """Take the outputs back from the row dropper (reads their counts: not for inside an iteration)."""
        self.sequences, self.generated = outputs.sequences, outputs.generated
        self.scores, self.raw_logits = outputs.scores, outputs.raw_logits

    def update_stats(self) -> SpeculationStats:
        """Fill in the statistics read from the device or the timers (histogram, phase times, compactions;
        total_time_s: prefill plus the iterations run so far). Reads the device: call it between iterations."""
        self.stats.compactions = self.target_runner.compactions + self.drafter.compactions
        self.stats.accepted_histogram = self.histogram()
        self.stats.draft_time_s = self.timer.seconds("draft")
        self.stats.verify_time_s = self.timer.seconds("verify")
        self.stats.total_time_s = self.timer.seconds("step") + self.timer.seconds("prefill")
        return self.stats

    def collected_scores(self, longest: int, device: torch.device | None = None):
        """HF-style tuples of [B, V] per generated step (``scores``, ``logits``), or None when not requested: a
        contiguous copy per step, as HF's (views of one [B, steps, V] copy could not be ``view``-ed as HF's can, and
        one kept step kept every step alive), made by the caller's mode (outside inference mode: ordinary tensors, as
        HF's), on ``device`` (None: the loop's; model.generate's are on its ids' device)."""
        def split(buffer):
            if buffer is None:
                return None
            check_free_memory({"copy": buffer[:, :longest].nbytes, "total": buffer[:, :longest].nbytes}, self.device,
                              f"the returned scores/logits ({self.batch} rows x {longest} steps x {self.vocab} ids)")
            return tuple(buffer[:, s].to(device or buffer.device, copy=True, memory_format=torch.contiguous_format)
                         for s in range(longest))

        return split(self.scores), split(self.raw_logits)


def criterion_fired(criterion, input_ids: torch.Tensor, scores) -> bool:
    """Whether a caller's stopping criterion stops the row input_ids [1, L] (scores: HF's tuple or None). Its answer
    is one value, as HF reads it for a batch of one (a bool tensor [1]; a bool or a one-element list is taken too).
    What HF cannot read is named here: None (a torch error there), or several values for the one row (model.generate
    fails on them inside torch; they were read as "any of them")."""
    name = getattr(criterion, "__name__", None) or type(criterion).__name__
    answer = criterion(input_ids, scores)
    try:
        fired = torch.as_tensor(answer)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"stopping criterion {name} returned {type(answer).__name__}, not a bool tensor [1] (one "
                        "value per row; generate's stopping_criteria run at batch size 1)") from error
    if fired.numel() != 1:
        raise ValueError(f"stopping criterion {name} returned {fired.numel()} values for the one row it was given "
                         f"(shape {tuple(fired.shape)}); it must return a bool tensor [1]")
    return bool(fired.item())
