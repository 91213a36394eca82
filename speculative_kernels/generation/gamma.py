"""Choosing the draft length gamma from the paper's speedup model (Leviathan et al. 2023, section 3): the expected
speedup (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) (Theorem 3.8), and ``GammaCalibrator``, which measures
alpha and c over a run's first iterations for ``num_speculative_tokens="auto"`` and then keeps re-estimating alpha;
where no gamma is expected to pay for its drafting, it pauses speculation (gamma 0: plain decoding) and probes now
and then whether drafts have started to be accepted. How: ``docs/architecture.md``."""

import collections
import dataclasses
import math
import statistics

MAX_GAMMA = 16
CALIBRATION_GAMMA = 4
CALIBRATION_WARMUP = 1  # iterations whose times are not used (first-call allocations, lazy initialisation)
CALIBRATION_ITERATIONS = 4  # timed iterations
RECHECK_EVERY = 8  # after the choice: alpha is re-estimated every this many iterations
RECHECK_WINDOW = 16  # ... over this many latest iterations (c stays the calibration's)
RECHECK_MARGIN = 0.02  # switch only to a gamma expected this much faster than the one in use
# Pause (gamma 0, plain decoding) where the best gamma's expected speedup is below PAUSE_BELOW: drafting is expected
# to cost clearly more than it saves (alpha well below c); resume where it reaches RESUME_AT. Between the two the
# state stays: a drafter that costs almost nothing (c ~ 0.02: the n-gram drafter) keeps drafting at alpha 0 (which
# costs it little) and so sees its acceptance rise without waiting for probes
PAUSE_BELOW = 0.9
RESUME_AT = 1.0
PROBE_EVERY = 16  # while paused: one iteration at ``resume_gamma`` after this many plain ones, to re-estimate alpha


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per iteration (accepted drafts + the one target token), eq. 1: (1 - a^(g+1)) / (1 - a)."""
    _check_alpha(alpha)
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    """Theorem 3.8: (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)); gamma >= 0 (0 is plain decoding, 1.0)."""
    if c < 0 or not math.isfinite(c):
        raise ValueError(f"c must be a finite number >= 0, got {c}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def choose_gamma(alpha: float, c: float, max_gamma: int = MAX_GAMMA) -> int:
    """The gamma in 1..max_gamma with the largest expected speedup (the smallest such gamma on ties)."""
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    return max(range(1, max_gamma + 1), key=lambda g: (expected_speedup(alpha, g, c), -g))


def alpha_from_counts(accepted_counts, gamma: int) -> float:
    """Maximum-likelihood alpha from accepted counts n in 0..gamma (one per row and iteration, all at one gamma).

    A row with n < gamma made n + 1 accept tests and one failed; a row with n == gamma passed all gamma tests."""
    successes = tests = 0
    for n in accepted_counts:
        if not 0 <= n <= gamma:
            raise ValueError(f"accepted count {n} is outside 0..{gamma}")
        successes += n
        tests += n + (1 if n < gamma else 0)
    if tests == 0:
        raise ValueError("no accept tests to estimate alpha from")
    return successes / tests


def accept_tests(histogram) -> tuple[int, int]:
    """(passed accept tests, accept tests made) behind a histogram: histogram[n] = iterations (per row) that
    accepted n of gamma = len(histogram) - 1 drafts. Sums of these over several histograms pool their alpha."""
    gamma = len(histogram) - 1
    successes = sum(n * k for n, k in enumerate(histogram))
    return successes, successes + sum(k for n, k in enumerate(histogram) if n < gamma)


def alpha_from_histogram(histogram) -> float:
    """alpha_from_counts for a histogram (see ``accept_tests``)."""
    successes, tests = accept_tests(histogram)
    if tests == 0:
        raise ValueError("no accept tests to estimate alpha from")
    return successes / tests


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


@dataclasses.dataclass
class GammaCalibrator:
    """Measures alpha and c over a loop's first iterations and then picks gamma (see the module docstring).

    The loop calls ``record`` once per iteration with host values it already has; ``record`` returns the gamma to
    use from the next iteration on once calibration is complete, else None; then ``observe`` (see there).

    allow_pause: a choice may be 0, plain decoding, where no gamma >= 1 is expected to reach ``PAUSE_BELOW``; the
    loop then runs an iteration at ``resume_gamma`` whenever ``probe_due`` (its drafter catches up on the tokens
    emitted meanwhile in its first forward: the loop's drafters take the tokens of iterations that drafted nothing
    as pending inputs; compile=True, whose draft steps have fixed widths, refuses "auto").
    """

    start_gamma: int = CALIBRATION_GAMMA
    warmup: int = CALIBRATION_WARMUP
    iterations: int = CALIBRATION_ITERATIONS
    max_gamma: int = MAX_GAMMA
    counts: list = dataclasses.field(default_factory=list)  # accepted drafts per row and iteration
    drafted: list = dataclasses.field(default_factory=list)  # drafts per row and iteration (its own limit)
    draft_seconds: list = dataclasses.field(default_factory=list)  # per timed iteration, per draft forward
    verify_seconds: list = dataclasses.field(default_factory=list)  # per timed iteration
    seen: int = 0
    alpha: float | None = None
    c: float | None = None
    chosen: int | None = None
    recheck_every: int = RECHECK_EVERY
    recent: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECHECK_WINDOW))  # (passed, tests) per iteration
    since_check: int = 0
    allow_pause: bool = True
    resume_gamma: int | None = None  # while paused (chosen 0): the best gamma >= 1 at the latest alpha, for probes
    since_probe: int = 0  # while paused: plain iterations since the pause or the last probe

    @property
    def done(self) -> bool:
        return self.chosen is not None

    @property
    def paused(self) -> bool:
        """Speculation is paused: the chosen gamma is 0 (plain decoding)."""
        return self.chosen == 0

    @property
    def probe_due(self) -> bool:
        """While paused: the next iteration drafts ``resume_gamma`` tokens, to re-estimate alpha."""
        return self.paused and self.since_probe >= PROBE_EVERY

    def _window_alpha(self) -> float | None:
        """alpha over the window of recent iterations' accept tests (None where they made none)."""
        passed, tests = (sum(column) for column in zip(*self.recent))
        return passed / tests if tests else None

    def _choose(self, alpha: float) -> int:
        """The gamma to use at this alpha and the calibration's c: ``choose_gamma``'s, or 0 (where pausing is
        allowed) when even that one is expected to be slower than ``PAUSE_BELOW`` times plain decoding (while
        paused: to stay below ``RESUME_AT``)."""
        best = choose_gamma(alpha, self.c, self.max_gamma)
        self.resume_gamma = best
        threshold = RESUME_AT if self.paused else PAUSE_BELOW
        if self.allow_pause and expected_speedup(alpha, best, self.c) < threshold:
            self.since_probe = 0
            return 0
        return best

    def record(self, accepted_counts, draft_seconds: float, verify_seconds: float, drafted=None) -> int | None:
        """accepted_counts: n of each row still generating in this iteration; drafted: the drafts d >= n each of
        those rows had (a row near its end is drafted fewer than ``start_gamma``: accepting all d is no
        rejection), None for ``start_gamma`` each; draft_seconds / verify_seconds: the iteration's draft and
        verification phase times."""
        if self.done:
            return None
        accepted_counts = list(accepted_counts)
        drafted = [self.start_gamma] * len(accepted_counts) if drafted is None else list(drafted)
        _check_counts(accepted_counts, drafted)
        self.seen += 1
        self.counts.extend(accepted_counts)
        self.drafted.extend(drafted)
        if self.seen > self.warmup:
            self.draft_seconds.append(draft_seconds / self.start_gamma)
            self.verify_seconds.append(verify_seconds)
        if self.seen < self.warmup + self.iterations:
            return None
        return self.finish()

    def observe(self, accepted_counts, drafted) -> int | None:
        """After the choice, every iteration drafted at the chosen gamma: the rows' accepted counts and drafts (as
        ``record``). Every ``recheck_every`` iterations alpha is re-estimated over the latest ones (acceptance drifts:
        a prompt-lookup or n-gram drafter finds little to copy at first and much later) and the gamma that
        maximises the speedup at the calibration's c is returned when it is expected to be ``RECHECK_MARGIN``
        faster than the one in use (or 0, a pause, where even the best is expected below ``PAUSE_BELOW``); else None.
        While paused, every iteration is observed: a plain one (nothing drafted) counts towards the next probe; a
        probe's tests join the window, and speculation resumes at the gamma the window's alpha picks unless that is
        0 again (it is until some gamma is expected to reach ``RESUME_AT``). Host values only: no timing is read (on
        CUDA that would wait)."""
        if not self.done:
            raise RuntimeError("observe() follows the choice; record() calibrates")
        accepted_counts, drafted = list(accepted_counts), list(drafted)
        _check_counts(accepted_counts, drafted)
        if self.paused:
            if not any(drafted):
                self.since_probe += 1
                return None
            self.since_probe = 0
            self.recent.append(_accept_tests(accepted_counts, drafted))
            self.alpha = self._window_alpha()  # (a probe made at least one test)
            best = self._choose(self.alpha)
            if best == 0:
                return None
            self.chosen, self.since_check = best, 0
            return best
        self.recent.append(_accept_tests(accepted_counts, drafted))
        self.since_check += 1
        if self.since_check < self.recheck_every or self.c is None:
            return None
        self.since_check = 0
        alpha = self._window_alpha()
        if alpha is None:
            return None
        best = self._choose(alpha)
        if best == self.chosen or best != 0 and \
                expected_speedup(alpha, best, self.c) <= (1 + RECHECK_MARGIN) * expected_speedup(alpha, self.chosen,
                                                                                               self.c):
            return None
        self.alpha, self.chosen = alpha, best
        return best

    def finish(self) -> int:
        """Choose gamma from what was recorded (also usable early, e.g. when decoding ends during calibration)."""
        passed, tests = _accept_tests(self.counts, self.drafted)
        if not tests or not self.verify_seconds:
            self.chosen = self.start_gamma
            return self.chosen
        self.alpha = passed / tests  # the maximum-likelihood estimate, as alpha_from_counts, each row with its d
        verify = statistics.median(self.verify_seconds)
        self.c = statistics.median(self.draft_seconds) / verify if verify > 0 else 0.0
        self.chosen = self._choose(self.alpha)
        if self.paused:  # the probes' alpha starts from the calibration's evidence
            self.recent.append((passed, tests))
        return self.chosen


def _check_counts(accepted_counts: list[int], drafted: list[int]) -> None:
    if len(drafted) != len(accepted_counts) or any(not 0 <= n <= d for n, d in zip(accepted_counts, drafted)):
        raise ValueError(f"accepted counts {accepted_counts} do not fit the drafted counts {drafted}")


def _accept_tests(accepted_counts: list[int], drafted: list[int]) -> tuple[int, int]:
    """(passed, made) accept tests of rows that accepted n of their d drafts: n passed, n + (n < d) made."""
    passed = sum(accepted_counts)
    return passed, passed + sum(n < d for n, d in zip(accepted_counts, drafted))
