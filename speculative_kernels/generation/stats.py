"""Speculation statistics: acceptance, tokens per target forward, forward counts, phase times."""

import dataclasses
import time

import torch

from .gamma import alpha_from_histogram


@dataclasses.dataclass
class SpeculationStats:
    """Filled in by ``generate``. Counts are summed over the rows that were still generating.

    A row-step is one row in one target forward (every forward that produced tokens: those that verified a full
    gamma of drafts, a shorter proposal (the last tokens of a request, prompt lookup without a long match) or
    nothing (the target alone), and a first token taken from the prompt's forward).

    accepted_histogram[n] counts the row-steps that kept n drafts: the row emitted n + 1 tokens, n accepted drafts
    and then the target's token, or, where EOS, max_new_tokens or a stop string cut the row inside its accepted
    drafts, n + 1 = the tokens it emitted (n = min(accepted, emitted - 1)); n in 0..the largest gamma used.
    """

    num_speculative_tokens: int = 0
    # target forwards that produced tokens: the verifications, and the prompt's forward where the first token
    # comes from it (max_new_tokens=1; greedy requests of continuous batching; a target whose Mamba2 mixers bound dt,
    # ``ModelSpec.bounded_step_size``); the target's other prefill is in prefill_forwards
    target_forwards: int = 0
    draft_forwards: int = 0  # the draft model's forwards while drafting (its prefill is in prefill_forwards)
    # prefill forwards over the prompts: the target's (1, or one per chunk with prefill_chunk_size), the draft's
    # running beside them (0 when the prompt has one token; where the target's prefill is the forward that gives the
    # first token, its last forward is counted in target_forwards)
    prefill_forwards: int = 0
    # drafts verified, per row-step at most the row's tokens left less one (drafts past its end are not counted),
    # and only those the drafter proposed (prompt lookup's fillers are not counted)
    drafted_tokens: int = 0
    # accepted drafts that were kept: sum of n over the row-steps (see accepted_histogram); drafts accepted by the
    # verification but cut by EOS, max_new_tokens or a stop string are not counted
    accepted_tokens: int = 0
    new_tokens: int = 0
    accepted_histogram: list = dataclasses.field(default_factory=list)
    # the paper's accept tests (per row-step with n of its d drafted accepted by the verification, n <= d: n
    # passed, n + (n < d) made; drafts after an EOS in them were tested too and count)
    accept_tests: int = 0
    accept_tests_passed: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    # prefill (an encoder-decoder's encoder pass included, which prefill_forwards does not count) + decoding;
    # excludes warmup_time_s
    total_time_s: float = 0.0
    warmup_time_s: float = 0.0  # compile=True: compiling and recording the captured steps (not in total_time_s)
    compactions: int = 0  # hole compactions of either cache (batch > 1)
    dropped_rows: int = 0  # finished rows removed from the batch before the end

    @property
    def acceptance_rate(self) -> float:
        """accepted_tokens over drafted_tokens. Lower than the paper's alpha: the drafts after a rejection
        count as drafted but were never tested (see :attr:`alpha`)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def alpha(self) -> float:
        """The paper's alpha, the per-token acceptance probability: maximum-likelihood estimate, successful accept
        tests over tests made, each row and iteration counted with the drafts it had (so iterations of different
        gamma, as with num_speculative_tokens="auto", and rows proposing fewer drafts count right); 0.0 before
        any test. (Stats filled in without the test counts fall back to ``accepted_histogram``, read as if every
        row-step had drafted len(accepted_histogram) - 1 tokens.)"""
        if self.accept_tests:
            return self.accept_tests_passed / self.accept_tests
        return alpha_from_histogram(self.accepted_histogram) if self.verify_steps else 0.0

    @property
    def verify_steps(self) -> int:
        """Row-steps: the rows in each target forward, summed (see the class docstring)."""
        return int(sum(self.accepted_histogram))

    @property
    def mean_tokens_per_target_forward(self) -> float:
        """Tokens emitted per row-step, the mean of n + 1 over ``accepted_histogram``: new_tokens / verify_steps
        (at batch 1, new_tokens / target_forwards). Every target forward counts, also those that drafted fewer
        than gamma or nothing; at a fixed gamma with every row-step full, the paper's tokens per iteration."""
        steps = self.verify_steps
        if not steps:
            return 0.0
        return sum((n + 1) * c for n, c in enumerate(self.accepted_histogram)) / steps

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s else 0.0

    def summary(self) -> str:
        return (
            f"acceptance {self.acceptance_rate:.3f} (alpha {self.alpha:.3f}), "
            f"{self.mean_tokens_per_target_forward:.2f} tokens/target forward, "
            f"{self.target_forwards} target + {self.draft_forwards} draft forwards, "
            f"histogram {self.accepted_histogram}, draft {self.draft_time_s * 1e3:.1f} ms, "
            f"verify {self.verify_time_s * 1e3:.1f} ms"
            + (f", warm-up {self.warmup_time_s:.1f} s" if self.warmup_time_s else "")
        )


class PhaseTimer:
    """Accumulates time per phase without host synchronisation: CUDA events on GPU (read once at the end),
    ``perf_counter`` elsewhere. Completed spans are folded into a running total once a phase holds ``FOLD_AT``
    (on CUDA, those whose end event has run: ``query()`` does not wait), so a loop that runs for hours (a server's
    running batch) keeps a bounded number of events; the last span of each phase is always kept (``last``)."""

    FOLD_AT = 64

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}  # spans not folded yet, oldest first
        self.folded: dict[str, float] = {}  # seconds of the spans folded
        self._open: dict = {}

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, spans) -> float:
        if self.cuda:
            return sum(b.elapsed_time(e) for b, e in spans) / 1e3
        return sum(e - b for b, e in spans)

    def start(self, phase: str) -> None:
        self._open[phase] = self._now()

    def stop(self, phase: str) -> None:
        self.spans.setdefault(phase, []).append((self._open.pop(phase), self._now()))
        self._fold(phase)

    def _fold(self, phase: str) -> None:
        """Once the phase holds FOLD_AT spans: its completed ones but the last into the running total."""
        spans = self.spans[phase]
        if len(spans) >= self.FOLD_AT:
            done = 0
            for _, end in spans[:-1]:
                if self.cuda and not end.query():
                    break
                done += 1
            self.folded[phase] = self.folded.get(phase, 0.0) + self._elapsed(spans[:done])
            del spans[:done]

    def last(self, phase: str) -> float:
        """Seconds of the phase's last span (on CUDA, waiting for its end event)."""
        span = self.spans[phase][-1]
        if self.cuda:
            span[1].synchronize()
        return self._elapsed([span])

    def seconds(self, phase: str) -> float:
        spans = self.spans.get(phase, [])
        if self.cuda and spans:
            spans[-1][1].synchronize()
        return self.folded.get(phase, 0.0) + self._elapsed(spans)

    def merge(self, other: "PhaseTimer") -> None:
        """Take ``other``'s time into this timer (this timer's last spans stay the last)."""
        for phase, seconds in other.folded.items():
            self.folded[phase] = self.folded.get(phase, 0.0) + seconds
        for phase, spans in other.spans.items():  # (folded here too: a running batch's prefill phase, which every
            self.spans[phase] = spans + self.spans.get(phase, [])  # joining request's merges, never stops again)
            self._fold(phase)
