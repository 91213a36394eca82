"""The speculative decoding loop (Leviathan et al. 2023, Algorithm 1): one ``step`` drafts, verifies, emits and
rolls back for every row at once, with one device-to-host read (the iteration's flags, tokens and the lengths the
runners asked for). The walk-through of an iteration is in ``docs/architecture.md``."""

from collections.abc import Callable
from types import ModuleType

import torch

from ..ops.diagnostics import raise_for_invalid_rows
from ..ops.randomness import DecodeRandomness
from ..ops.warping import warp_logits
from .buffers import initial_new_tokens, widen
from .drafter import Drafter
from .gamma import GammaCalibrator
from .logit_masks import LogitMasks
from .memory import check_free_memory
from .options import BatchingOptions
from .rows import Outputs, RowDropper
from .runners import Runner
from .settings import Plan
from .stats import PhaseTimer, SpeculationStats


class SpeculativeLoop:
    """Runs one batch of prompts to completion (``run``), or one iteration at a time (``step``, for a server).

    Built complete by ``request.build_loop``. target: the target model's ``Runner``; drafter: what proposes the
    tokens (``drafter.py``); input_ids, attention_mask: [B, L], the (decoder) prompts, left-padded; vocab: V of the
    target's logits; dtype: the verification's dtype (the target's); impl: the module implementing ``verify``/``sample``
    (``ops.backends.implementation``); batching: when finished rows leave the batch in ``run``; warm_up: called after
    the prefill, returns its seconds (``compile=True``: captures and warms up the steps); seed: the run's random
    numbers (``DecodeRandomness``; None: drawn from torch's default generator).
    """

    def __init__(self, target: Runner, drafter: Drafter, plan: Plan, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, *, vocab: int, dtype: torch.dtype, impl: ModuleType,
                 batching: BatchingOptions = BatchingOptions(), warm_up: Callable[[], float] | None = None,
                 seed: int | None = None):
        self.target_runner, self.drafter, self.plan = target, drafter, plan
        self.impl, self.batching, self.vocab, self._dtype = impl, batching, vocab, dtype
        self.device = input_ids.device
        self.batch, self.prompt_length = input_ids.shape
        # num_speculative_tokens="auto": start at the calibration gamma, choose after a few iterations (gamma.py);
        # buffers are sized for the largest gamma it may choose.
        self.calibrator = GammaCalibrator(max_gamma=plan.max_gamma) if plan.num_speculative_tokens == "auto" else None
        self.chosen_gamma = self.calibrator.start_gamma if self.calibrator else plan.num_speculative_tokens
        self.gamma = self.chosen_gamma  # this iteration's: chosen_gamma, capped by the tokens left (_step_gamma)
        self.max_gamma = plan.max_gamma
        self._largest_gamma_used = self.gamma
        self.sampling = plan.sampling
        self.sequences_fill = plan.pad_token_id if plan.pad_token_id is not None else 0
        width = self._buffer_width(self.prompt_length + initial_new_tokens(plan.max_new_tokens))
        self._check_memory(width)
        self.sequences = torch.full((self.batch, width), self.sequences_fill, dtype=torch.int64, device=self.device)
        self.sequences[:, : self.prompt_length] = input_ids
        self.generated = torch.zeros(self.batch, dtype=torch.int64, device=self.device)
        self.finished = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        self._generated_host = [0] * self.batch  # host copies from the iterations' reads (for capacity and gamma)
        self._finished_host = [0] * self.batch
        self.eos = torch.tensor(plan.eos_token_ids or [-1], dtype=torch.int64, device=self.device)
        self.masks = LogitMasks(plan, self.prompt_length, vocab, self.device)
        self.randomness = DecodeRandomness(self.batch, self.device, seed)
        self.iteration = 0
        self.stats = SpeculationStats(num_speculative_tokens=self.gamma, accepted_histogram=[0] * (self.gamma + 1))
        self._histogram = torch.zeros(self.max_gamma + 1, dtype=torch.int64, device=self.device)
        self.timer = PhaseTimer(self.device)
        self.scores = self._score_buffer() if plan.output_scores else None
        self.raw_logits = self._score_buffer() if plan.output_logits else None
        self._prefill(input_ids, attention_mask)
        if warm_up is not None:
            self.stats.warmup_time_s = warm_up()

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
        return torch.zeros(self.batch, self.sequences.shape[1] - self.prompt_length, self.vocab, device=self.device)

    def _step_gamma(self) -> int:
        """This iteration's gamma: the chosen one, but never more than the most tokens an unfinished row still has
        to generate, less one (HF caps the same way); 0 when one token is left."""
        left = max((self.plan.max_new_tokens - g for g, f in zip(self._generated_host, self._finished_host)
                    if not f), default=1)
        gamma = max(0, min(self.chosen_gamma, left - 1))
        proposals = self.drafter.proposal_counts()  # a drafter without a model: no longer than its longest proposal
        if proposals is not None:
            gamma = min(gamma, max((c for c, f in zip(proposals, self._finished_host) if not f), default=0))
        return gamma

    def _prefill(self, input_ids, attention_mask) -> None:
        real = attention_mask.to(torch.bool)
        if self.prompt_length > 1:
            self.timer.start("prefill")
            self.target_runner.forward(input_ids[:, :-1], real[:, :-1], last_only=True)
            self.drafter.start(input_ids, real)
            self.timer.stop("prefill")
            self.stats.prefill_forwards += 1
        else:
            self.drafter.start(input_ids, real)
        self.last = input_ids[:, -1]

    # ----------------------------------------------------------------------------------------------- steps
    def _choose_draft_token(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        """The drafter's ``choose``: draft logits [B, V] of draft position i masked in place as the target's are
        (``LogitMasks``), then the token [B] drawn from them."""
        if self.masks.active:
            self.masks.apply(logits.unsqueeze(1), (self.generated + i).unsqueeze(1))
        if self.sampling.greedy:
            # The backends' greedy sample is argmax over float32 (first index on ties); an invalid row (NaN, all
            # -inf) is still caught: verify checks the stored draft logits.
            return logits.float().argmax(dim=-1)
        token = self.impl.sample(logits, self.sampling, self.randomness.draft())
        self.randomness.advance_draft()
        return token

    def _verify(self, draft_tokens, draft_logits, num_draft):
        s = self.sampling
        target_in = torch.cat([self.last.unsqueeze(1), draft_tokens.clamp(min=0)], dim=1)
        logits = self.target_runner.forward(target_in)
        raw = logits.clone() if self.raw_logits is not None else None
        if self.masks.active:
            self.masks.apply(logits, self.generated.unsqueeze(1) + torch.arange(self.gamma + 1, device=self.device))
        self.stats.target_forwards += 1
        if self.gamma == 0:  # nothing drafted: one token from the target alone, on an unused draft-stream offset
            token = self.impl.sample(logits[:, 0], s, self.randomness.draft())
            if not s.greedy:
                self.randomness.advance_draft()
            return token.unsqueeze(1), torch.where(token < 0, -1, 0), logits, raw
        q_logits = None if draft_logits is None else draft_logits.to(logits.dtype)  # None: q one-hot at the drafts
        # num_draft [B] int64 (or None: all gamma): rows that proposed fewer tokens (prompt lookup without a long
        # match) carry fillers past num_draft[b], which the verification never accepts: such a row emits the
        # target's own token at num_draft[b] (from p there when it accepted every proposal, else the residual).
        out, accepted = self.impl.verify(logits, q_logits, draft_tokens, s, self.randomness.verify(),
                                         num_draft_tokens=num_draft)
        if not s.greedy:
            self.randomness.advance_verify()
        return out, accepted, logits, raw

    def _emit(self, out: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """Write each row's new tokens (cut at EOS / max_new_tokens) into the output; returns counts [B]."""
        positions = torch.arange(self.gamma + 1, device=self.device).unsqueeze(0)
        count = accepted.clamp(min=0) + 1
        is_eos = torch.isin(out, self.eos) & (positions < count.unsqueeze(1))
        has_eos = is_eos.any(dim=1)
        count = torch.where(has_eos, is_eos.to(torch.int64).argmax(dim=1) + 1, count)
        count = torch.minimum(count, self.plan.max_new_tokens - self.generated)
        count = count.masked_fill(self.finished, 0)
        index = self.prompt_length + self.generated.unsqueeze(1) + positions
        keep = positions < count.unsqueeze(1)
        self.sequences.scatter_(1, index, torch.where(keep, out, self.sequences.gather(1, index)))
        # Scatter-add, not bincount over a boolean selection (that would read the selection's size on the host).
        # Iterations shortened at the end (gamma below the chosen one) stay out: their counts would bias alpha.
        if self.gamma == self.chosen_gamma:
            self._histogram.index_add_(0, accepted.clamp(min=0), (~self.finished).to(torch.int64))
        self.finished = self.finished | (has_eos & keep.any(dim=1)) | (self.generated + count >= self.plan.max_new_tokens)
        self.generated = self.generated + count
        return count

    def _store_scores(self, processed, raw, count, generated_before) -> None:
        """Per emitted token: HF's ``scores`` (warped target logits) and ``logits`` (raw)."""
        positions = torch.arange(self.gamma + 1, device=self.device).unsqueeze(0)
        index = (generated_before.unsqueeze(1) + positions).unsqueeze(-1).expand(-1, -1, processed.shape[-1])
        keep = (positions < count.unsqueeze(1)).unsqueeze(-1)
        for buffer, values in ((self.scores, processed), (self.raw_logits, raw)):
            if buffer is None:
                continue
            if buffer is self.scores and not self.sampling.greedy:
                values = warp_logits(values, self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)
            buffer.scatter_(1, index, torch.where(keep, values.float(), buffer.gather(1, index)))

    def _draft(self):
        """gamma draft tokens per row. Returns (tokens [B, gamma] int64, q's logits [B, gamma, V] or None,
        num_draft [B] int64 or None: the drafter's per-row counts)."""
        if self.gamma == 0:
            return torch.empty(self.batch, 0, dtype=torch.int64, device=self.device), None, None
        tokens, logits, num_draft = self.drafter.propose(self.gamma, self._choose_draft_token)
        self.stats.draft_forwards = self.drafter.forwards
        return tokens, logits, num_draft

    def _roll_back(self, out, accepted, draft_tokens, accepted_host: list[int]) -> None:
        """Both caches keep what was accepted; finished rows keep no new slots, so no row outgrows prompt +
        max_new_tokens. out [B, gamma + 1]: the emitted tokens; accepted [B]."""
        max_n = max(accepted_host)
        done = self.finished
        self.target_runner.keep_prefix(self.gamma + 1, (accepted + 1).masked_fill(done, 0), max_n + 1)
        self.last = out.gather(1, accepted.clamp(min=0).unsqueeze(1)).squeeze(1)
        if self.gamma > 0:
            self.drafter.accept(draft_tokens, accepted, accepted_host, self.last, done)

    def step(self) -> bool:
        """One draft + verify iteration for every unfinished row. Returns True while any row is unfinished.

        Afterwards ``emitted()`` lists the token ids each row emitted (read in the iteration's one host read).
        """
        self.timer.start("step")
        self.gamma = self._step_gamma()
        self._reserve(self.prompt_length + max(self._generated_host) + 1)
        self.timer.start("draft")
        proposals = self.drafter.proposal_counts()
        draft_tokens, draft_logits, num_draft = self._draft()
        self.timer.stop("draft")
        self.timer.start("verify")
        out, accepted, processed, raw = self._verify(draft_tokens, draft_logits, num_draft)
        generated_before = self.generated
        active_before = ~self.finished
        count = self._emit(out, accepted)
        self.drafter.observe(out, count)
        self.timer.stop("verify")
        if self.scores is not None or self.raw_logits is not None:
            self._store_scores(processed, raw, count, generated_before)
        # The one device-to-host read of the iteration; the runners' lengths (hole compaction, capacity bounds) ride
        # along.
        flags = [accepted, count, self.finished.to(torch.int64), active_before.to(torch.int64)]
        readers = [(r, r.lengths_to_read()) for r in (self.target_runner, self.drafter)]
        readers = [(r, lengths) for r, lengths in readers if lengths is not None]
        host = torch.cat([*flags, out.flatten(), *(lengths for _, lengths in readers)]).tolist()
        b = self.batch
        accepted_host, count_host = host[:b], host[b : 2 * b]
        finished_host, active_host = host[2 * b : 3 * b], host[3 * b : 4 * b]
        tail = 4 * b + out.numel()
        self._host_tokens, self._host_counts, self._finished_host = host[4 * b : tail], count_host, finished_host
        self._host_width = self.gamma + 1
        self._generated_host = [g + c for g, c in zip(self._generated_host, count_host)]
        for reader, lengths in readers:
            reader.lengths_read(host[tail : tail + lengths.numel()])
            tail += lengths.numel()
        if min(accepted_host) < 0:
            raise_for_invalid_rows(accepted, temperature=self.sampling.temperature, target_logits=processed,
                                   draft_logits=draft_logits, draft_tokens=draft_tokens)
        if self._after_emit(count_host, accepted_host, active_host, generated_before, proposals):
            finished_host = self._finished_host = [1] * b  # a stopping criterion ended the (batch-1) request
        # gamma 0 with every row finished (one token was left): no rollback needed; otherwise (a drafter without a
        # model had no proposal) the target keeps its one slot in running rows.
        if self.gamma > 0 or not all(finished_host):
            self._roll_back(out, accepted, draft_tokens, accepted_host)
        if self.calibrator is not None and not self.calibrator.done and self.gamma == self.chosen_gamma:
            self._calibrate([n for n, a in zip(accepted_host, active_host) if a])
        self.iteration += 1
        self.timer.stop("step")
        return not all(finished_host)

    def _calibrate(self, accepted_counts: list[int]) -> None:
        """num_speculative_tokens="auto": feed this iteration to the calibrator; switch gamma once it has chosen.
        The phase times are complete here: the iteration's host read has already waited for the device."""
        chosen = self.calibrator.record(accepted_counts, self._last_seconds("draft"), self._last_seconds("verify"))
        if chosen is not None:
            self.chosen_gamma = self.stats.num_speculative_tokens = chosen
            self._largest_gamma_used = max(self._largest_gamma_used, chosen)

    def _last_seconds(self, phase: str) -> float:
        begin, end = self.timer.spans[phase][-1]
        return begin.elapsed_time(end) / 1e3 if self.timer.cuda else end - begin

    def histogram(self) -> list[int]:
        """accepted_histogram: [n] = verification steps (per row) that accepted n drafts, n in 0..largest gamma."""
        return self._histogram[: self._largest_gamma_used + 1].tolist()

    def emitted(self) -> list[list[int]]:
        """Token ids each row emitted in the last ``step()`` (after EOS / length / stopping-criteria cuts)."""
        width = self._host_width
        tokens, counts = self._host_tokens, self._host_counts
        return [tokens[row * width : row * width + counts[row]] for row in range(self.batch)]

    def _after_emit(self, count_host, accepted_host, active_host, generated_before, proposals) -> bool:
        """Host-side bookkeeping that needs the counts: stats, stopping criteria, streamer. Returns True when a
        stopping criterion fired (the host's finished flags, read before it ran, are then stale). proposals: the
        drafter's per-row counts of this iteration (host), or None for gamma each."""
        active = [i for i, a in enumerate(active_host) if a]
        self.stats.drafted_tokens += sum(self.gamma if proposals is None else min(proposals[i], self.gamma)
                                         for i in active)
        self.stats.accepted_tokens += sum(accepted_host[i] for i in active)
        self.stats.new_tokens += sum(count_host)
        stopped = False
        if self.plan.stopping_criteria:
            stopped = self._apply_stopping_criteria(count_host, generated_before)
            count_host = self._host_counts
        if self.plan.streamer is not None and count_host[0] > 0:
            start = self.prompt_length + int(generated_before[0])
            self.plan.streamer.put(self.sequences[:, start : start + count_host[0]].cpu())
        return stopped

    def _apply_stopping_criteria(self, count_host, generated_before) -> bool:
        """User stopping criteria, evaluated after every emitted token as HF does (batch 1). Returns whether one
        fired; then the tokens after it are cut and every row is finished."""
        start = self.prompt_length + int(generated_before[0])
        for j in range(count_host[0]):
            ids = self.sequences[:, : start + j + 1]
            if any(bool(torch.as_tensor(c(ids, None)).any()) for c in self.plan.stopping_criteria):
                self.sequences[:, start + j + 1 : start + count_host[0]] = self.plan.pad_token_id or 0
                self.generated = generated_before + (j + 1)
                self._host_counts = [j + 1]
                self.finished = torch.ones_like(self.finished)
                return True
        return False

    def run(self):
        """Generate until every row finished. Returns (sequences [B, L + new], SpeculationStats)."""
        if self.plan.streamer is not None:
            self.plan.streamer.put(self.sequences[:, : self.prompt_length].cpu())
        self.timer.start("total")
        running = self.plan.max_new_tokens > 0
        dropper = RowDropper(self.batching, self.sequences_fill)
        while running:
            running = self.step()
            if running and dropper.due(self._finished_host):
                self._drop_finished_rows(dropper)
        full = dropper.finish(self._outputs())
        if full is not None:  # every row back, in its original place
            self._set_outputs(full)
            self.batch = full.generated.shape[0]
            self.finished = torch.ones(self.batch, dtype=torch.bool, device=self.device)
        self.stats.dropped_rows = dropper.dropped
        self.timer.stop("total")
        if self.plan.streamer is not None:
            self.plan.streamer.end()
        longest = int(self.generated.max()) if self.batch else 0
        self.update_stats()
        self.stats.total_time_s = self.timer.seconds("total") + self.timer.seconds("prefill")
        return self.sequences[:, : self.prompt_length + longest], self.stats

    def _drop_finished_rows(self, dropper: RowDropper) -> None:
        """Keep only the unfinished rows in every per-row state: outputs, flags, keys, runners (the row choice is
        made on the device from the finished flags; the host flags say how many remain)."""
        remaining = [i for i, f in enumerate(self._finished_host) if not f]
        keep = torch.argsort(self.finished.to(torch.int8), stable=True)[: len(remaining)]  # unfinished rows, in order
        self._set_outputs(dropper.drop(self._outputs(), keep))
        self.finished = self.finished.index_select(0, keep)
        self.last = self.last.index_select(0, keep)
        self.randomness.select_rows(keep)
        self.target_runner.select_rows(keep)
        self.drafter.select_rows(keep)
        self._generated_host = [self._generated_host[i] for i in remaining]
        self._finished_host = [self._finished_host[i] for i in remaining]
        self.batch = len(remaining)

    def _outputs(self) -> Outputs:
        return Outputs(self.sequences, self.generated, self.scores, self.raw_logits)

    def _set_outputs(self, outputs: Outputs) -> None:
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

    def collected_scores(self, longest: int):
        """HF-style tuples of [B, V] per generated step (``scores``, ``logits``), or None when not requested."""
        def split(buffer):
            return None if buffer is None else tuple(buffer[:, s] for s in range(longest))

        return split(self.scores), split(self.raw_logits)
