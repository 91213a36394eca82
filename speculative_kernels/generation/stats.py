"""Speculation statistics: acceptance, tokens per target forward, forward counts, phase times."""

import dataclasses
import time

import torch

from .gamma import alpha_from_histogram


@dataclasses.dataclass
class SpeculationStats:
    """Filled in by ``generate``. Counts are summed over the rows that were still generating.

    accepted_histogram[n] counts verification steps (per row) that accepted exactly n draft tokens (0..gamma).
    """

    num_speculative_tokens: int = 0
    target_forwards: int = 0  # verification forwards (the prefill is counted in prefill_forwards)
    draft_forwards: int = 0
    prefill_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    new_tokens: int = 0
    accepted_histogram: list = dataclasses.field(default_factory=list)
    # the paper's accept tests (per row and iteration with n of its d drafts accepted: n passed, n + (n < d) made)
    accept_tests: int = 0
    accept_tests_passed: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0  # prefill + decoding; excludes warmup_time_s
    warmup_time_s: float = 0.0  # compile=True: compiling and recording the captured steps (not in total_time_s)
    compactions: int = 0  # hole compactions of either cache (batch > 1)
    dropped_rows: int = 0  # finished rows removed from the batch before the end

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens. Lower than the paper's alpha: the drafts after a rejection
        count as drafted but were never tested (see :attr:`alpha`)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def alpha(self) -> float:
        """The paper's alpha, the per-token acceptance probability: maximum-likelihood estimate, successful accept
        tests over tests made, each row and iteration counted with the drafts it had (so iterations of different
        gamma, as with num_speculative_tokens="auto", and rows proposing fewer drafts count right); 0.0 before
        any test. (Stats filled in without the test counts fall back to ``accepted_histogram``, one gamma.)"""
        if self.accept_tests:
            return self.accept_tests_passed / self.accept_tests
        return alpha_from_histogram(self.accepted_histogram) if self.verify_steps else 0.0

    @property
    def verify_steps(self) -> int:
        return int(sum(self.accepted_histogram))

    @property
    def mean_tokens_per_target_forward(self) -> float:
        """Mean of (accepted + 1) per row and verification step: the paper's expected tokens per iteration."""
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
        spans = self.spans.setdefault(phase, [])
        spans.append((self._open.pop(phase), self._now()))
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
        for phase, spans in other.spans.items():
            self.spans[phase] = spans + self.spans.get(phase, [])
