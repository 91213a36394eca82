"""Choosing the draft length gamma from the paper's speedup model (Leviathan et al. 2023, section 3): the expected
speedup (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) (Theorem 3.8), and ``GammaCalibrator``, which measures
alpha and c over a run's first iterations for ``num_speculative_tokens="auto"`` and then keeps re-estimating alpha;
where no gamma is expected to pay for its drafting, it pauses speculation (gamma 0: plain decoding) and probes now
and then whether drafts have started to be accepted. How: ``docs/architecture.md``.

The paper prices a verification of gamma + 1 tokens as one plain step. On a CPU, and at batch > 1 anywhere the
forward is not bound by reading the weights, it costs more (the demo pair at batch 16: about 1.5 steps for 5
tokens), and the loop adds work per drafting iteration (the verification op, processors over the block); priced at one
step, "auto" kept drafting where drafting lost (0.83x plain decoding at batch 16 with an n-gram ban). So the
calibration also times plain steps (``CALIBRATION_PLAIN_ITERATIONS``) in the same run, and the verification's cost
in plain steps (``width_cost``, w) decides the pause: "auto" pauses where even the best gamma is expected below
``PAUSE_BELOW`` with a verification priced by ``verification_cost`` (an upper bound of its cost at any gamma).
Which gamma to draft stays the paper's choice (at c = a draft forward over a verification, as measured): where
speculation wins, the choice is what it was. Two exceptions keep the one-step price for the pause: the
calibration's own alpha (the run's first 5 iterations, where a drafter that learns from the context, the n-gram
drafter, is rejected and later accepted), and a drafter that costs almost nothing to run (c below
``FREE_DRAFTER_C``: n-gram, prompt lookup), whose acceptance comes in runs that a window of 16 iterations and a
probe every 16 plain ones miss. At the measured price those paused and lost: the n-gram drafter at batch 1 on the
demo pair, 1.24-1.58x plain decoding against 1.50-1.62x (``benchmarks/auto_gamma.py --one-step-rows``)."""

import collections
import dataclasses
import math
import statistics

MAX_GAMMA = 16
CALIBRATION_GAMMA = 4
CALIBRATION_WARMUP = 1  # iterations whose times are not used (first-call allocations, lazy initialisation)
CALIBRATION_ITERATIONS = 4  # timed iterations
# Plain iterations (gamma 0: the target alone) timed after those, in the same run: what a verification of gamma + 1
# tokens costs against a one-token step (its width cost) is priced from them (``GammaCalibrator.finish``)
CALIBRATION_PLAIN_ITERATIONS = 2
RECHECK_EVERY = 8  # after the choice: alpha is re-estimated every this many iterations
RECHECK_WINDOW = 16  # ... over this many latest iterations (c stays the calibration's)
RECHECK_MARGIN = 0.02  # switch only to a gamma expected this much faster than the one in use
# Pause (gamma 0, plain decoding) where the best gamma's expected speedup is below PAUSE_BELOW: drafting is expected
# to cost clearly more than it saves (alpha well below c); resume where it reaches RESUME_AT. Between the two the
# state stays: a drafter that costs almost nothing (c ~ 0.02: the n-gram drafter) keeps drafting at alpha 0 (which
# costs it little) and so sees its acceptance rise without waiting for probes
PAUSE_BELOW = 0.9
RESUME_AT = 1.0
# A drafter whose forward costs less than this share of a verification (the n-gram drafter: ~0.02; prompt lookup)
# is priced at one step per verification, as before the width cost: see the module docstring
FREE_DRAFTER_C = 0.05
PROBE_EVERY = 16  # while paused: one iteration at ``resume_gamma`` after this many plain ones, to re-estimate alpha


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per iteration (accepted drafts + the one target token), eq. 1: (1 - a^(g+1)) / (1 - a)."""
    _check_alpha(alpha)
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def verification_cost(gamma: int, width_cost: float = 1.0, calibration_gamma: int = CALIBRATION_GAMMA) -> float:
    """A verification of gamma + 1 tokens in plain steps, from ``width_cost`` w, the one of calibration_gamma + 1
    tokens measured: 1 + (w - 1) max(1, gamma / calibration_gamma) for gamma >= 1 (1 for gamma 0, a plain step;
    1 for every gamma where w <= 1: the paper's). Of a cost that grows with gamma and ever slower (a forward's: the
    demo target 1.13 steps at 2 tokens, 1.21 at 5, 1.30 at 9), this is an upper bound: the measured cost below the
    calibration's gamma (part of it, the verification op and the loop's work, does not shrink with gamma), a line
    above it."""
    if gamma == 0 or width_cost <= 1.0:
        return 1.0
    return 1.0 + (width_cost - 1.0) * max(1.0, gamma / calibration_gamma)


def expected_speedup(alpha: float, gamma: int, c: float, width_cost: float = 1.0,
                     calibration_gamma: int = CALIBRATION_GAMMA) -> float:
    """Theorem 3.8: (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)); gamma >= 0 (0 is plain decoding, 1.0). With
    a width cost w > 1, the verification's 1 is its cost in plain steps (``verification_cost``), and c a draft
    forward over a plain step."""
    if c < 0 or not math.isfinite(c):
        raise ValueError(f"c must be a finite number >= 0, got {c}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    return expected_tokens(alpha, gamma) / (gamma * c + verification_cost(gamma, width_cost, calibration_gamma))


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

    plain_iterations: plain iterations (gamma 0) timed after the calibration's drafting ones (``calibration_gamma``
    says which the next iteration is): ``width_cost``, the verification over a plain step, is measured from them and
    prices the pause (see the module docstring); 0: the paper's model alone (where no plain step was timed, e.g.
    decoding ended first, the same).
    allow_pause: a choice may be 0, plain decoding, where no gamma >= 1 is expected to reach ``PAUSE_BELOW``; the
    loop then runs an iteration at ``resume_gamma`` whenever ``probe_due`` (its drafter catches up on the tokens
    emitted meanwhile in its first forward: the loop's drafters take the tokens of iterations that drafted nothing
    as pending inputs; compile=True, whose draft steps have fixed widths, refuses "auto").
    """

    start_gamma: int = CALIBRATION_GAMMA
    warmup: int = CALIBRATION_WARMUP
    iterations: int = CALIBRATION_ITERATIONS
    plain_iterations: int = CALIBRATION_PLAIN_ITERATIONS
    max_gamma: int = MAX_GAMMA
    counts: list = dataclasses.field(default_factory=list)  # accepted drafts per row and iteration
    drafted: list = dataclasses.field(default_factory=list)  # drafts per row and iteration (its own limit)
    draft_seconds: list = dataclasses.field(default_factory=list)  # per timed iteration, per draft forward
    verify_seconds: list = dataclasses.field(default_factory=list)  # per timed iteration
    plain_seconds: list = dataclasses.field(default_factory=list)  # per timed plain iteration: draft + verify phase
    seen: int = 0
    alpha: float | None = None
    c: float | None = None
    width_cost: float | None = None  # the calibration's verification over a plain step (None: none timed)
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
    def calibration_gamma(self) -> int:
        """Before the choice: the gamma of the next iteration (``start_gamma``, then 0 for the plain ones)."""
        return 0 if self.seen >= self.warmup + self.iterations else self.start_gamma

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

    def _choose(self, alpha: float, calibrating: bool = False) -> int:
        """The gamma to use at this alpha and the calibration's c: ``choose_gamma``'s (the paper's price), or 0
        (where pausing is allowed) when even the best gamma is expected to be slower than ``PAUSE_BELOW`` times
        plain decoding (while paused: to stay below ``RESUME_AT``) at the measured price of a verification
        (``measured_speedup``). calibrating: the calibration's own alpha, from the run's first iterations, pauses
        only where the paper's price says so too: a drafter that learns from the context (n-gram, prompt lookup)
        is rejected there and accepted later, and would wait for probes (the module docstring)."""
        best = choose_gamma(alpha, self.c, self.max_gamma)
        self.resume_gamma = best
        threshold = RESUME_AT if self.paused else PAUSE_BELOW
        expected = self.measured_speedup(alpha)
        if calibrating:
            expected = max(expected, expected_speedup(alpha, best, self.c))
        if self.allow_pause and expected < threshold:
            self.since_probe = 0
            return 0
        return best

    def measured_speedup(self, alpha: float) -> float:
        """The best gamma's expected speedup at alpha with a verification at its measured cost (``width_cost``;
        c in plain steps: c w), or at the paper's one step where no plain step was timed."""
        if self.width_cost is None:
            return expected_speedup(alpha, choose_gamma(alpha, self.c, self.max_gamma), self.c)
        c, w = self.c * self.width_cost, self.width_cost
        return max(expected_speedup(alpha, g, c, w, self.start_gamma) for g in range(1, self.max_gamma + 1))

    def record(self, accepted_counts, draft_seconds: float, verify_seconds: float, drafted=None) -> int | None:
        """accepted_counts: n of each row still generating in this iteration; drafted: the drafts d >= n each of
        those rows had (a row near its end is drafted fewer than ``start_gamma``: accepting all d is no
        rejection), None for ``start_gamma`` each; draft_seconds / verify_seconds: the iteration's draft and
        verification phase times. A plain iteration (``calibration_gamma`` 0) is recorded by its times alone."""
        if self.done:
            return None
        if self.calibration_gamma == 0:
            self.seen += 1
            self.plain_seconds.append(draft_seconds + verify_seconds)
            return self.finish() if self.seen >= self.warmup + self.iterations + self.plain_iterations else None
        accepted_counts = list(accepted_counts)
        drafted = [self.start_gamma] * len(accepted_counts) if drafted is None else list(drafted)
        _check_counts(accepted_counts, drafted)
        self.seen += 1
        self.counts.extend(accepted_counts)
        self.drafted.extend(drafted)
        if self.seen > self.warmup:
            self.draft_seconds.append(draft_seconds / self.start_gamma)
            self.verify_seconds.append(verify_seconds)
        if self.seen < self.warmup + self.iterations + self.plain_iterations:
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
        self.c = self._cost_per_draft()
        self.chosen = self._choose(self.alpha, calibrating=True)
        if self.paused:  # the probes' alpha starts from the calibration's evidence
            self.recent.append((passed, tests))
        return self.chosen

    def _cost_per_draft(self) -> float:
        """c, a draft forward over a verification (the paper's); and ``width_cost``, the verification over a plain
        step, where plain steps were timed and the drafter is not nearly free (``FREE_DRAFTER_C``)."""
        draft, verify = statistics.median(self.draft_seconds), statistics.median(self.verify_seconds)
        step = statistics.median(self.plain_seconds) if self.plain_seconds else 0.0
        c = draft / verify if verify > 0 else 0.0
        if step > 0 and verify > 0 and c >= FREE_DRAFTER_C:
            self.width_cost = verify / step
        return c


def _check_counts(accepted_counts: list[int], drafted: list[int]) -> None:
    if len(drafted) != len(accepted_counts) or any(not 0 <= n <= d for n, d in zip(accepted_counts, drafted)):
        raise ValueError(f"accepted counts {accepted_counts} do not fit the drafted counts {drafted}")


def _accept_tests(accepted_counts: list[int], drafted: list[int]) -> tuple[int, int]:
    """(passed, made) accept tests of rows that accepted n of their d drafts: n passed, n + (n < d) made."""
    passed = sum(accepted_counts)
    return passed, passed + sum(n < d for n, d in zip(accepted_counts, drafted))
