"""The speculative decoding loop (Leviathan et al. 2023, Algorithm 1) over two HF decoder-only models.

One iteration, for every row at once:
  1. draft: gamma single-token forwards of the draft, each sampled by ``ops.sample`` from the warped draft logits
     (stored, so verification recomputes exactly the q each token was drawn from); no host synchronisation;
  2. verify: one target forward over [last token, x_1..x_gamma] and ``ops.verify`` -> accepted count n and the
     emitted tokens (accepted drafts + one residual/bonus token);
  3. emit: cut each row at its first EOS and at max_new_tokens, write the tokens into the output buffer;
  4. one device-to-host read of (n, finished, count) per iteration; then roll both caches back (``runner.py``).

An iteration drafts no more tokens than any unfinished row still has to generate, less one (the target adds one):
with one token left it drafts none and samples the target alone. Buffers (the output, scores, the runners' slot
masks) are sized by what has been generated and grow geometrically, each growth checked against the device's free
memory (``memory.py``), so a huge ``max_new_tokens`` costs nothing up front.
"""

import torch

from ..ops import backends
from ..ops.diagnostics import raise_for_invalid_rows
from ..ops.randomness import DecodeRandomness
from .compaction import BatchingOptions, RowDropper, compactions, widen
from .gamma import GammaCalibrator
from .memory import check_free_memory
from .runner import DecoderRunner
from .settings import Plan
from .stats import PhaseTimer, SpeculationStats

INITIAL_NEW_TOKENS = 256  # output/score buffers start with room for this many new tokens, then double


def _wants_host_lengths(runner) -> bool:
    """Whether a runner takes its rows' ``next_position`` from the iteration's host read: hole compaction (an
    enabled ``compactor``) or a runner asking by ``wants_host_lengths`` (``seq2seq_static.py``: its capacity check)."""
    compactor = getattr(runner, "compactor", None)
    return (compactor is not None and compactor.enabled) or getattr(runner, "wants_host_lengths", False)


def _give_host_lengths(runner, lengths: list[int]) -> None:
    """Hand the rows' lengths (read before the rollback: upper bounds after it) to whoever asked for them."""
    compactor = getattr(runner, "compactor", None)
    if compactor is not None and compactor.enabled:
        compactor.host_counts = lengths
    if getattr(runner, "wants_host_lengths", False):
        runner.host_lengths = lengths


class SpeculativeLoop:
    """Runs one batch of prompts to completion. Build it, call ``run()``; a server can also drive ``step()``.

    input_ids, attention_mask: [B, L] (left padding only): the (decoder) prompt. ``bridge``: a ``VocabBridge``.
    ``runner_factory(model, batch, max_slots, device)`` builds the object that drives each model (``runner.py``'s
    ``DecoderRunner`` by default; anything with its ``forward``/``keep_prefix`` interface fits, e.g. a static-cache
    or an encoder-decoder runner).
    """

    def __init__(self, target, draft, bridge, plan: Plan, input_ids, attention_mask, backend: str = "auto",
                 runner_factory=DecoderRunner):
        self.target, self.draft, self.bridge, self.plan = target, draft, bridge, plan
        self.device = input_ids.device
        self.batch, self.prompt_length = input_ids.shape
        # num_speculative_tokens="auto": start at the calibration gamma, choose after a few iterations (gamma.py);
        # buffers are sized for the largest gamma it may choose.
        self.calibrator = GammaCalibrator() if plan.num_speculative_tokens == "auto" else None
        self.chosen_gamma = self.calibrator.start_gamma if self.calibrator else plan.num_speculative_tokens
        self.gamma = self.chosen_gamma  # this iteration's: chosen_gamma, capped by the tokens left (_step_gamma)
        self.max_gamma = self.calibrator.max_gamma if self.calibrator else self.gamma
        self._largest_gamma_used = self.gamma
        self.impl = backends.implementation(backend, self.device.type)
        self._dtype = next(target.parameters()).dtype  # verification runs in the target's dtype
        self.sampling = plan.sampling
        self.target_runner = runner_factory(target, self.batch, self.max_slots(), self.device)
        self.draft_runner = runner_factory(draft, self.batch, self.max_slots(), self.device)
        self.sequences_fill = plan.pad_token_id if plan.pad_token_id is not None else 0
        width = self._buffer_width(self.prompt_length + min(plan.max_new_tokens, INITIAL_NEW_TOKENS))
        self._check_memory(width)
        self.sequences = torch.full((self.batch, width), self.sequences_fill, dtype=torch.int64, device=self.device)
        self.sequences[:, : self.prompt_length] = input_ids
        self.generated = torch.zeros(self.batch, dtype=torch.int64, device=self.device)
        self.finished = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        self._generated_host = [0] * self.batch  # host copies from the iterations' reads (for capacity and gamma)
        self._finished_host = [0] * self.batch
        self.eos = torch.tensor(plan.eos_token_ids or [-1], dtype=torch.int64, device=self.device)
        vocab = bridge.target_width
        self._eos_columns = torch.zeros(vocab, dtype=torch.bool, device=self.device)  # [V]: True at EOS ids
        self._eos_columns[[e for e in plan.eos_token_ids if 0 <= e < vocab]] = True
        self._forced = self._forced_columns(vocab)
        self.randomness = DecodeRandomness(self.batch, self.device)
        self.batching = BatchingOptions()  # run() drops finished rows by these rules (set by generate)
        self.iteration = 0
        self._masks_logits = bool(self._forced) or (plan.min_new_tokens > 0 and bool(plan.eos_token_ids))
        self.stats = SpeculationStats(num_speculative_tokens=self.gamma, accepted_histogram=[0] * (self.gamma + 1))
        self._histogram = torch.zeros(self.max_gamma + 1, dtype=torch.int64, device=self.device)
        self.timer = PhaseTimer(self.device)
        self.scores = self._score_buffer() if plan.output_scores else None
        self.raw_logits = self._score_buffer() if plan.output_logits else None
        self._prefill(input_ids, attention_mask)

    # ----------------------------------------------------------------------------------------------- set-up
    def max_slots(self) -> int:
        """Initial cache-slot width of the runners' slot masks (they grow as needed): the prompt, a few iterations'
        worth of slots and room for the first new tokens."""
        return self.prompt_length + 4 * (self.max_gamma + 2) + min(self.plan.max_new_tokens, INITIAL_NEW_TOKENS)

    def _buffer_width(self, length: int) -> int:
        """Output-buffer width for sequences of ``length`` tokens: the slack of one iteration's scatter (gamma + 1
        positions past the last token), never more than the whole request needs."""
        return min(length, self.prompt_length + self.plan.max_new_tokens) + self.max_gamma + 1

    def _check_memory(self, width: int) -> None:
        """MemoryError before allocating output buffers of ``width`` columns that the device cannot hold."""
        vocab = self.bridge.target_width
        per_column = 8 + 4 * vocab * (int(self.plan.output_scores) + int(self.plan.output_logits))
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
        vocab = self.bridge.target_width
        return torch.zeros(self.batch, self.sequences.shape[1] - self.prompt_length, vocab, device=self.device)

    def select_host_rows(self, rows: list[int]) -> None:
        """Keep the host copies of rows ``rows`` (when finished rows leave the batch, ``compaction.RowDropper``)."""
        self._generated_host = [self._generated_host[i] for i in rows]
        self._finished_host = [self._finished_host[i] for i in rows]

    def _step_gamma(self) -> int:
        """This iteration's gamma: the chosen one, but never more than the most tokens an unfinished row still has
        to generate, less one (HF caps the same way); 0 when one token is left."""
        left = max((self.plan.max_new_tokens - g for g, f in zip(self._generated_host, self._finished_host)
                    if not f), default=1)
        return max(0, min(self.chosen_gamma, left - 1))

    def _prefill(self, input_ids, attention_mask) -> None:
        real = attention_mask.to(torch.bool)
        if self.prompt_length > 1:
            self.timer.start("prefill")
            self.target_runner.forward(input_ids[:, :-1], real[:, :-1], last_only=True)
            self.draft_runner.forward(self.bridge.draft_inputs(input_ids[:, :-1]), real[:, :-1], last_only=True)
            self.timer.stop("prefill")
            self.stats.prefill_forwards += 1
        self.last = input_ids[:, -1]
        self.pending = (input_ids[:, -1:], None)  # draft tokens not in its cache yet, and which are real

    # ----------------------------------------------------------------------------------------------- steps
    def _mask_min_new(self, logits: torch.Tensor, generated_before: torch.Tensor) -> None:
        """EOS gets -inf where fewer than min_new_tokens have been generated. logits [B, T, V]; generated [B, T]."""
        if self.plan.min_new_tokens <= 0 or not self.plan.eos_token_ids:
            return
        too_early = (generated_before < self.plan.min_new_tokens).unsqueeze(-1)
        logits.masked_fill_(too_early & self._eos_columns, float("-inf"))

    def _forced_columns(self, vocab: int) -> list:
        """HF's ForcedBOS/ForcedEOSTokenLogitsProcessor as (generated index, [V] bool columns kept): forced_bos at
        decoder length 1 (only when the prompt is a single token), forced_eos at max_length - 1."""
        config, forced = self.plan.generation_config, []
        for token_ids, at in ((config.forced_bos_token_id, 1 - self.prompt_length),
                              (config.forced_eos_token_id, self.plan.max_new_tokens - 1)):
            ids = [] if token_ids is None else [token_ids] if isinstance(token_ids, int) else list(token_ids)
            if not ids or at < 0:
                continue
            if not all(0 <= i < vocab for i in ids):
                raise ValueError(f"forced token ids {ids} are outside the vocabulary (size {vocab})")
            columns = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            columns[ids] = True
            forced.append((at, columns))
        return forced

    def _mask_forced(self, logits: torch.Tensor, generated_before: torch.Tensor) -> None:
        """At a forced position every logit is -inf except the forced token's, which is 0 (as HF sets it).
        logits [B, T, V]; generated_before [B, T]."""
        for at, columns in self._forced:
            hit = (generated_before == at).unsqueeze(-1)
            logits.masked_fill_(hit & ~columns, float("-inf")).masked_fill_(hit & columns, 0.0)

    def _draft(self, dtype: torch.dtype):
        """gamma draft forwards. Returns (tokens [B, gamma] int64, logits [B, gamma, V] in ``dtype``, or None when
        gamma is 0)."""
        s, gamma = self.sampling, self.gamma
        tokens = torch.empty(self.batch, gamma, dtype=torch.int64, device=self.device)
        logits_buffer = None
        inputs, real = self.pending
        for i in range(gamma):
            logits = self.draft_runner.forward(self.bridge.draft_inputs(inputs), real, last_only=True)
            logits = self.bridge.draft_logits(logits)
            if logits.dtype != dtype:
                logits = logits.to(dtype)
            if self._masks_logits:
                self._mask_min_new(logits, (self.generated + i).unsqueeze(1))
                self._mask_forced(logits, (self.generated + i).unsqueeze(1))
            if logits_buffer is None:
                logits_buffer = torch.empty(self.batch, gamma, logits.shape[-1], dtype=dtype, device=self.device)
            logits_buffer[:, i] = logits[:, 0]
            if s.greedy:
                # The backends' greedy sample is argmax over float32 (first index on ties); an invalid row (NaN,
                # all -inf) is still caught: verify checks the stored draft logits.
                token = logits[:, 0].float().argmax(dim=-1)
            else:
                token = self.impl.sample(logits[:, 0], s, self.randomness.draft())
                self.randomness.advance_draft()
            tokens[:, i] = token
            inputs, real = token.clamp(min=0).unsqueeze(1), None
        self.stats.draft_forwards += gamma
        return tokens, logits_buffer

    def _verify(self, draft_tokens, draft_logits):
        s = self.sampling
        target_in = torch.cat([self.last.unsqueeze(1), draft_tokens.clamp(min=0)], dim=1)
        logits = self.target_runner.forward(target_in)
        raw = logits.clone() if self.raw_logits is not None else None
        if self._masks_logits:
            generated = self.generated.unsqueeze(1) + torch.arange(self.gamma + 1, device=self.device)
            self._mask_min_new(logits, generated)
            self._mask_forced(logits, generated)
        self.stats.target_forwards += 1
        if self.gamma == 0:  # nothing drafted: one token from the target alone, on an unused draft-stream offset
            token = self.impl.sample(logits[:, 0], s, self.randomness.draft())
            if not s.greedy:
                self.randomness.advance_draft()
            return token.unsqueeze(1), torch.where(token < 0, -1, 0), logits, raw
        out, accepted = self.impl.verify(logits, draft_logits.to(logits.dtype), draft_tokens, s,
                                         self.randomness.verify())
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
                from ..ops.warping import warp_logits

                values = warp_logits(values, self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)
            buffer.scatter_(1, index, torch.where(keep, values.float(), buffer.gather(1, index)))

    def _roll_back(self, accepted, accepted_host: list[int]) -> None:
        gamma = self.gamma
        max_n = max(accepted_host)
        done = self.finished  # finished rows keep no new slots, so no row outgrows prompt + max_new_tokens
        self.target_runner.keep_prefix(gamma + 1, (accepted + 1).masked_fill(done, 0), max_n + 1)
        pending_width = self.pending[0].shape[1]
        window = pending_width + gamma - 1
        kept = (pending_width + accepted.clamp(max=gamma - 1)).masked_fill(done, 0)
        self.draft_runner.keep_prefix(window, kept, pending_width + min(max_n, gamma - 1))

    def _next_pending(self, out, accepted, draft_tokens, accepted_host: list[int]) -> None:
        new = out.gather(1, accepted.clamp(min=0).unsqueeze(1)).squeeze(1)
        self.last = new
        if max(accepted_host) < self.gamma:
            self.pending = (new.unsqueeze(1), None)
            return
        all_in = accepted == self.gamma
        first = torch.where(all_in, draft_tokens[:, -1], torch.zeros_like(new))
        real = torch.stack([all_in, torch.ones_like(all_in)], dim=1)
        self.pending = (torch.stack([first, new], dim=1), None if all(a == self.gamma for a in accepted_host) else real)

    def step(self) -> bool:
        """One draft + verify iteration for every unfinished row. Returns True while any row is unfinished.

        Afterwards ``emitted()`` lists the token ids each row emitted (read in the iteration's one host read).
        """
        self.timer.start("step")
        self.gamma = self._step_gamma()
        self._reserve(self.prompt_length + max(self._generated_host) + 1)
        self.timer.start("draft")
        draft_tokens, draft_logits = self._draft(self._dtype)
        self.timer.stop("draft")
        self.timer.start("verify")
        out, accepted, processed, raw = self._verify(draft_tokens, draft_logits)
        generated_before = self.generated
        active_before = ~self.finished
        count = self._emit(out, accepted)
        self.timer.stop("verify")
        if self.scores is not None or self.raw_logits is not None:
            self._store_scores(processed, raw, count, generated_before)
        # The one device-to-host read of the iteration.
        flags = [accepted, count, self.finished.to(torch.int64), active_before.to(torch.int64)]
        # Runners that compact holes, or size-check a cache by row lengths, get their rows' counts in the same read.
        counted = [r for r in (self.target_runner, self.draft_runner) if _wants_host_lengths(r)]
        host = torch.cat([*flags, out.flatten(), *(r.next_position for r in counted)]).tolist()
        b = self.batch
        accepted_host, count_host = host[:b], host[b : 2 * b]
        finished_host, active_host = host[2 * b : 3 * b], host[3 * b : 4 * b]
        tail = 4 * b + out.numel()
        self._host_tokens, self._host_counts, self._finished_host = host[4 * b : tail], count_host, finished_host
        self._host_width = self.gamma + 1
        self._generated_host = [g + c for g, c in zip(self._generated_host, count_host)]
        for i, runner in enumerate(counted):
            _give_host_lengths(runner, host[tail + i * b : tail + (i + 1) * b])
        if min(accepted_host) < 0:
            raise_for_invalid_rows(accepted, temperature=self.sampling.temperature, target_logits=processed,
                                   draft_logits=draft_logits, draft_tokens=draft_tokens)
        if self._after_emit(count_host, accepted_host, active_host, generated_before):
            finished_host = self._finished_host = [1] * b  # a stopping criterion ended the (batch-1) request
        if self.gamma > 0:  # gamma 0 is the last iteration (one token left for every row): no rollback needed
            self._roll_back(accepted, accepted_host)
            self._next_pending(out, accepted, draft_tokens, accepted_host)
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

    def _after_emit(self, count_host, accepted_host, active_host, generated_before) -> bool:
        """Host-side bookkeeping that needs the counts: stats, stopping criteria, streamer. Returns True when a
        stopping criterion fired (the host's finished flags, read before it ran, are then stale)."""
        active = [i for i, a in enumerate(active_host) if a]
        self.stats.drafted_tokens += self.gamma * len(active)
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
        dropper = RowDropper(self.batching)
        while running:
            running = self.step()
            if running:
                dropper.maybe_drop(self, self._finished_host)
        dropper.finish(self)
        self.stats.dropped_rows, self.stats.compactions = dropper.dropped, compactions(self)
        self.timer.stop("total")
        if self.plan.streamer is not None:
            self.plan.streamer.end()
        longest = int(self.generated.max()) if self.batch else 0
        self.update_stats()
        self.stats.total_time_s = self.timer.seconds("total") + self.timer.seconds("prefill")
        return self.sequences[:, : self.prompt_length + longest], self.stats

    def update_stats(self) -> SpeculationStats:
        """Fill in the statistics read from the device or the timers (histogram, phase times; total_time_s: prefill
        plus the iterations run so far). Reads the device: call it between iterations, not inside one."""
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
