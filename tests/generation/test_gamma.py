"""gamma.py: the paper's speedup formula, the gamma chooser, the alpha estimate, and num_speculative_tokens="auto"."""

import random

import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama, perturbed
from speculative_kernels.generation import gamma as gamma_mod
from speculative_kernels.generation.drafter import emitted_counts
from speculative_kernels.generation.gamma import (
    GammaCalibrator,
    alpha_from_counts,
    alpha_from_histogram,
    choose_gamma,
    expected_speedup,
    expected_tokens,
)


def test_expected_tokens_and_speedup_formula():
    # eq. 1 and Theorem 3.8, by hand: alpha 0.8, gamma 4, c 0.1 -> (1 - 0.8^5) / 0.2 = 3.3616 tokens, / 1.4
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert expected_tokens(0.0, 7) == 1.0
    assert expected_tokens(1.0, 7) == 8.0  # the alpha -> 1 limit, not 0/0
    assert expected_speedup(1.0, 3, 0.5) == pytest.approx(4 / 2.5)
    assert expected_speedup(0.6, 0, 0.3) == 1.0  # gamma 0 is plain decoding
    assert expected_speedup(0.0, 2, 0.25) == pytest.approx(1 / 1.5)  # nothing accepted: pure overhead
    for bad in (dict(alpha=-0.1, gamma=2, c=0.1), dict(alpha=1.1, gamma=2, c=0.1), dict(alpha=0.5, gamma=2, c=-1),
                dict(alpha=0.5, gamma=-1, c=0.1), dict(alpha=0.5, gamma=2, c=float("inf"))):
        with pytest.raises(ValueError):
            expected_speedup(**bad)


def test_choose_gamma_maximises_the_formula():
    # alpha 0.8, c 0.1: speedups 1.64, 2.03, 2.27, 2.40, 2.46, 2.470 (gamma 6), 2.448 -> 6
    assert choose_gamma(0.8, 0.1) == 6
    assert choose_gamma(0.0, 0.1) == 1  # nothing is ever accepted: the shortest
    assert choose_gamma(0.9, 1.0) == 1  # a draft as slow as the target: speedup <= 1 for all, best at 1
    assert choose_gamma(0.9, 0.0) == 16  # a free draft: the longest allowed
    assert choose_gamma(1.0, 0.01, max_gamma=5) == 5
    for alpha in (0.3, 0.55, 0.7, 0.85, 0.95):
        for c in (0.01, 0.05, 0.2, 0.5):
            best = max(range(1, 17), key=lambda g: expected_speedup(alpha, g, c))
            assert choose_gamma(alpha, c) == best
    with pytest.raises(ValueError):
        choose_gamma(0.5, 0.1, max_gamma=0)


def test_alpha_estimate_is_the_acceptance_probability():
    rng = random.Random(0)
    alpha, g = 0.7, 4
    counts = []
    for _ in range(20000):
        n = 0
        while n < g and rng.random() < alpha:
            n += 1
        counts.append(n)
    estimate = alpha_from_counts(counts, g)
    assert estimate == pytest.approx(alpha, abs=0.01)
    naive = sum(counts) / (g * len(counts))  # accepted / drafted: biased low, which is why it is not used
    assert naive < alpha - 0.1
    histogram = [counts.count(n) for n in range(g + 1)]
    assert alpha_from_histogram(histogram) == pytest.approx(estimate)
    assert alpha_from_counts([g] * 5, g) == 1.0
    assert alpha_from_counts([0] * 5, g) == 0.0
    with pytest.raises(ValueError):
        alpha_from_counts([5], g)
    with pytest.raises(ValueError):
        alpha_from_counts([], g)


def test_calibrator_skips_warmup_and_chooses():
    cal = GammaCalibrator(start_gamma=4, warmup=1, iterations=3)
    assert cal.record([4], draft_seconds=100.0, verify_seconds=1.0) is None  # warm-up: time ignored
    assert cal.record([3, 4], draft_seconds=0.4, verify_seconds=1.0) is None
    assert cal.record([2], draft_seconds=0.4, verify_seconds=1.0) is None
    chosen = cal.record([4], draft_seconds=0.4, verify_seconds=1.0)
    assert cal.c == pytest.approx(0.1)
    assert cal.alpha == pytest.approx(alpha_from_counts([4, 3, 4, 2, 4], 4))
    assert chosen == choose_gamma(cal.alpha, 0.1) and cal.done
    assert cal.record([0], 1.0, 1.0) is None  # done: no further changes
    early = GammaCalibrator()
    assert early.finish() == early.start_gamma  # nothing measured: keep the start


def _prompt(batch=1, length=6, seed=0):
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("forced", [2, 7])
def test_auto_switches_gamma_and_stays_greedy_identical(monkeypatch, forced):
    """Whatever gamma the calibration picks (forced here; timing decides it for real), greedy output is the
    target's, the switch happens after warm-up + measured iterations, and the statistics follow it."""
    monkeypatch.setattr(gamma_mod, "choose_gamma", lambda alpha, c, max_gamma=16: forced)
    monkeypatch.setattr(gamma_mod, "PAUSE_BELOW", 0.0)  # (the forced gamma is taken whatever it is expected to give)
    target = llama()
    draft = perturbed(target, scale=0.05)
    ids = _prompt(batch=3)
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens="auto", max_new_tokens=40,
                      do_sample=False, pad_token_id=0, speculation_stats=stats)
    assert torch.equal(got, expected)
    assert stats.num_speculative_tokens == forced
    assert len(stats.accepted_histogram) == max(forced, gamma_mod.CALIBRATION_GAMMA) + 1
    calibration = gamma_mod.CALIBRATION_WARMUP + gamma_mod.CALIBRATION_ITERATIONS
    # Every iteration drafts the calibration gamma, then the chosen one, except at the end, where gamma is capped
    # by the tokens left (at least one full iteration after the switch here).
    assert stats.draft_forwards <= calibration * 4 + (stats.target_forwards - calibration) * forced
    assert stats.draft_forwards >= calibration * 4 + forced


@pytest.mark.parametrize("forced", [1, 16])
def test_alpha_counts_each_iteration_with_its_own_gamma(monkeypatch, forced):
    """The draft is the target: every accept test passes, so alpha is 1 whatever gamma. With "auto" the histogram
    holds iterations of the calibration gamma and of the chosen one; alpha read it as if all had the largest gamma
    (a calibration iteration accepting its 4 of 4 counted as a rejection at 16: 0.93; at 1, a full γ=1 step as a
    rejection of 4)."""
    monkeypatch.setattr(gamma_mod, "choose_gamma", lambda alpha, c, max_gamma=16: forced)
    monkeypatch.setattr(gamma_mod, "PAUSE_BELOW", 0.0)  # (the forced gamma is taken whatever it is expected to give)
    target = llama()
    ids = _prompt(batch=2)
    runs = []
    for gamma in (4, "auto"):
        stats = sk.SpeculationStats()
        sk.generate(target, ids, draft_model=target, num_speculative_tokens=gamma, max_new_tokens=60,
                    do_sample=False, pad_token_id=0, eos_token_id=None, speculation_stats=stats)
        assert stats.num_speculative_tokens == (4 if gamma == 4 else forced)
        assert stats.acceptance_rate == 1.0 and stats.alpha == 1.0, (gamma, stats.accepted_histogram)
        runs.append(stats)
    for stats in runs:
        assert stats.accept_tests == stats.accepted_tokens == stats.accept_tests_passed


class _RecordOffsets:
    """Wraps a backend's draft sampler and records the Philox offsets it is called with."""

    def __init__(self, sample):
        self._sample, self.offsets = sample, []

    def __call__(self, logits, sampling, randomness):
        self.offsets.append(randomness.offset.clone())  # read after the step: no host read inside it
        return self._sample(logits, sampling, randomness)


def test_auto_session_one_host_read_and_sampling(monkeypatch):
    from helpers.host_reads import CountHostReads
    from speculative_kernels.ops import torch_backend  # what the loop calls on the CPU

    monkeypatch.setattr(gamma_mod, "choose_gamma", lambda alpha, c, max_gamma=16: 6)
    monkeypatch.setattr(gamma_mod, "PAUSE_BELOW", 0.0)  # (the forced gamma is taken whatever it is expected to give)
    target, draft = llama(), llama(layers=1, seed=4)
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens="auto").start(
        _prompt(batch=2), max_new_tokens=30, do_sample=True, temperature=0.8, pad_token_id=0)
    assert session.loop.impl is torch_backend
    recorder = _RecordOffsets(torch_backend.sample)
    monkeypatch.setattr(torch_backend, "sample", recorder)
    emitted = [[], []]
    unlimited_calls, gammas = 0, []  # sampler calls of the steps in which no row was limited by its tokens left
    while not session.finished:
        calls, left = len(recorder.offsets), [30 - len(tokens) for tokens in emitted]
        with CountHostReads() as counter:
            new_tokens = session.step()
        assert counter.reads == ["tolist"]
        gamma = len(recorder.offsets) - calls
        if unlimited_calls == calls and min(left) > gamma:  # each row drafts min(gamma, its tokens left - 1)
            unlimited_calls, gammas = unlimited_calls + gamma, gammas + [gamma]
        for row, tokens in enumerate(new_tokens):
            emitted[row] += tokens
    loop = session.loop
    assert loop.chosen_gamma == 6 and loop.calibrator.alpha is not None
    for row in range(2):  # what step() returned is what was written, in order, across the gamma switch
        assert loop.generated[row] == len(emitted[row])
        assert session.sequences()[row, 6 : 6 + len(emitted[row])].tolist() == emitted[row]
    # Draft random numbers are never reused: offsets run 0, 1, 2, ... across the switch from gamma 4 to 6 (up to
    # the first step that limits a row by its tokens left, which gives its fillers' offsets back).
    assert 4 in gammas and 6 in gammas, gammas
    offsets = [int(o[0]) for o in recorder.offsets[:unlimited_calls]]
    assert offsets == list(range(unlimited_calls))
    assert stats_consistent(session.stats)


def stats_consistent(stats) -> bool:
    return stats.verify_steps > 0 and len(stats.accepted_histogram) == 7 and stats.num_speculative_tokens == 6


def test_auto_with_real_calibration_and_refusals(monkeypatch):
    """A real calibration (the draft is the target, c measured by the clock) chooses a gamma and keeps the tokens.
    Pausing is off here: on a loaded CPU the measured c of a draft as large as its target reached 2, where pausing
    is the right choice (the pause has tests of its own)."""
    monkeypatch.setattr(gamma_mod, "PAUSE_BELOW", 0.0)
    target = llama()
    stats = sk.SpeculationStats()
    got = sk.generate(target, _prompt(), draft_model=target, num_speculative_tokens="auto", max_new_tokens=30,
                      do_sample=False, speculation_stats=stats)
    assert torch.equal(got, target.generate(_prompt(), max_new_tokens=30, do_sample=False))
    assert 1 <= stats.num_speculative_tokens <= 16
    with pytest.raises(ValueError, match="auto"):
        sk.generate(target, _prompt(), draft_model=target, num_speculative_tokens="auto", max_new_tokens=5,
                    cache_implementation="static")
    with pytest.raises(TypeError, match="int or 'auto'"):
        sk.generate(target, _prompt(), draft_model=target, num_speculative_tokens="five", max_new_tokens=5)


def test_calibrator_counts_each_rows_own_draft_limit():
    """A row drafted fewer than the calibration gamma (its tokens left less one) that accepted all of them failed
    no test (it was counted as a rejection at gamma, lowering alpha and so the gamma chosen)."""
    cal = GammaCalibrator(start_gamma=4, warmup=0, iterations=2)
    assert cal.record([4, 2], draft_seconds=0.4, verify_seconds=1.0, drafted=[4, 2]) is None
    cal.record([1], draft_seconds=0.4, verify_seconds=1.0, drafted=[1])
    assert cal.alpha == 1.0
    with pytest.raises(ValueError, match="do not fit"):
        GammaCalibrator().record([3], 0.4, 1.0, drafted=[2])


def test_auto_calibrates_on_what_each_row_was_drafted(monkeypatch):
    """The loop gives the calibrator each row's own draft count: with the draft as the target every test passes,
    so alpha is 1 even where rows near their end were drafted fewer than the calibration gamma."""
    seen = []
    finish = GammaCalibrator.finish

    def recording_finish(self):
        chosen = finish(self)
        seen.append(self.alpha)
        return chosen

    monkeypatch.setattr(GammaCalibrator, "finish", recording_finish)
    target = llama()
    decoder = sk.SpeculativeDecoder(target, target, num_speculative_tokens="auto")
    for max_new_tokens in (3, 4, 40):  # the first two are drafted 1 and 2, then 0 and 1 at the calibration gamma
        decoder.add_request(_prompt(batch=1)[0].tolist(), max_new_tokens=max_new_tokens, do_sample=True, seed=1)
    while decoder.has_work():
        decoder.step()
    assert seen and seen[0] == 1.0


def test_calibrator_keeps_reestimating_alpha_after_its_choice():
    """Acceptance drifts (a prompt-lookup or n-gram drafter finds little to copy at first): the first choice was
    final, so a run calibrated on rejections stayed at gamma 1. Every RECHECK_EVERY iterations alpha is re-estimated
    over the latest ones and a gamma expected RECHECK_MARGIN faster is taken (c stays the calibration's)."""
    cal = GammaCalibrator(start_gamma=4, warmup=0, iterations=2)
    assert cal.record([0], draft_seconds=0.04, verify_seconds=1.0) is None
    assert cal.record([0], draft_seconds=0.04, verify_seconds=1.0) == 1  # alpha 0
    with pytest.raises(ValueError, match="do not fit"):
        cal.observe([2], [1])
    for _ in range(gamma_mod.RECHECK_EVERY - 1):
        assert cal.observe([1], [1]) is None
    assert cal.observe([1], [1]) == choose_gamma(1.0, 0.01) == 16 and cal.alpha == 1.0
    for _ in range(gamma_mod.RECHECK_EVERY):  # no better gamma: no switch
        assert cal.observe([16], [16]) is None
    assert cal.chosen == 16


def test_auto_recovers_from_a_drafter_that_starts_badly():
    """A drafter whose first proposals are all rejected and later ones all accepted: "auto" calibrated on the
    rejections chose gamma 1 and kept it to the end; now it moves up once the drafts are accepted. Output stays
    model.generate's."""
    target = llama()
    ids = _prompt()
    expected = target.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None)
    continuation = expected[0, ids.shape[1]:].tolist()

    class LateBloomer:  # the Drafter protocol: right tokens from its 7th proposal on, wrong ones before
        forwards = compactions = 0

        def start(self, input_ids, real):
            self.position, self.calls = 0, 0

        def propose(self, gamma, choose):
            self.calls += 1
            tokens = [continuation[min(self.position + j, len(continuation) - 1)] for j in range(gamma)]
            if self.calls <= 6:
                tokens = [(token + 1) % 97 for token in tokens]
            return torch.tensor([tokens]), None, None

        def observe(self, out, accepted, finished):
            self.position += int(emitted_counts(accepted, finished)[0])

        def accept(self, *args):
            pass

        def proposal_counts(self):
            return None

        def lengths_to_read(self):
            return None

        def lengths_read(self, lengths):
            pass

    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, drafter=LateBloomer(), num_speculative_tokens="auto", max_new_tokens=60,
                      do_sample=False, eos_token_id=None, speculation_stats=stats)
    assert torch.equal(got, expected)
    assert stats.num_speculative_tokens > 1 and stats.accepted_tokens > 0


def test_choose_gamma_takes_the_smallest_of_equal_speedups():
    """alpha 0: every gamma gives 1 / (gamma c + 1), all 1 at c = 0: the smallest gamma (no drafting wasted); alpha 1
    at c = 0: each larger gamma is faster, so the largest allowed."""
    from speculative_kernels.generation.gamma import choose_gamma

    assert choose_gamma(0.0, 0.0) == 1
    assert choose_gamma(1.0, 0.0, max_gamma=8) == 8


def test_calibrator_pauses_where_no_gamma_pays_and_probes():
    """alpha well below c: every gamma is expected clearly slower than plain decoding (the paper's speedup below
    PAUSE_BELOW), so "auto" pauses speculation (gamma 0) rather than take the least bad gamma; while paused it probes
    at the best gamma every PROBE_EVERY plain iterations, and resumes once the window's alpha makes some gamma reach
    RESUME_AT."""
    cal = GammaCalibrator(start_gamma=4, warmup=0, iterations=2)
    assert cal.record([0], draft_seconds=2.0, verify_seconds=1.0) is None  # c = 0.5
    assert cal.record([0], draft_seconds=2.0, verify_seconds=1.0) == 0  # alpha 0: 1 / (gamma 0.5 + 1) < 0.9
    assert cal.paused and cal.resume_gamma == choose_gamma(0.0, 0.5) == 1 and not cal.probe_due
    for _ in range(gamma_mod.PROBE_EVERY):  # plain iterations: nothing drafted
        assert cal.observe([0], [0]) is None
    assert cal.probe_due
    assert cal.observe([0], [1]) is None  # a probe rejected: alpha 0 of 3 tests, still paused
    assert cal.paused and not cal.probe_due and cal.alpha == 0.0
    # Probes accepted: the calibration's 2 failed tests weigh until the window's alpha makes a gamma reach RESUME_AT
    passed, tests = 0, 3  # the window: the calibration's 0 of 2, the rejected probe's 0 of 1
    for _ in range(6):
        for _ in range(gamma_mod.PROBE_EVERY):
            cal.observe([0], [0])
        passed, tests = passed + 1, tests + 1
        alpha = passed / tests
        best = choose_gamma(alpha, 0.5)
        resumed = cal.observe([1], [1])
        if expected_speedup(alpha, best, 0.5) >= gamma_mod.RESUME_AT:
            break
        assert resumed is None and cal.paused
    assert resumed == best >= 1 and not cal.paused and passed > 1  # (not at the first accepted probe)
    # A draft as slow as the target that is always right (c = 1, alpha 1): every gamma gives 1.0, no pause; a
    # nearly free drafter that is never right (c = 0.02: 0.98) keeps drafting, and so learns when it starts to be
    cal = GammaCalibrator(start_gamma=4, warmup=0, iterations=1)
    assert cal.record([4], draft_seconds=4.0, verify_seconds=1.0) == 1 and not cal.paused
    cal = GammaCalibrator(start_gamma=4, warmup=0, iterations=1)
    assert cal.record([0], draft_seconds=0.08, verify_seconds=1.0) == 1 and not cal.paused
    # Without pausing (allow_pause=False), the least bad gamma, as before
    cal = GammaCalibrator(start_gamma=4, warmup=0, iterations=1, allow_pause=False)
    assert cal.record([0], draft_seconds=2.0, verify_seconds=1.0) == 1


def test_calibrator_pauses_on_a_reestimate_and_keeps_the_evidence():
    """After a choice, a re-estimate whose alpha makes no gamma pay pauses; the window it was made over is the
    probes' starting evidence."""
    cal = GammaCalibrator(start_gamma=4, warmup=0, iterations=1)
    assert cal.record([4], draft_seconds=0.8, verify_seconds=1.0) == choose_gamma(1.0, 0.2)  # c 0.2, alpha 1
    gamma = cal.chosen
    changes = [cal.observe([0], [gamma]) for _ in range(gamma_mod.RECHECK_EVERY)]
    assert changes[:-1] == [None] * (gamma_mod.RECHECK_EVERY - 1) and changes[-1] == 0 and cal.paused
    assert cal.resume_gamma == 1 and cal.alpha == 0.0
    for _ in range(gamma_mod.PROBE_EVERY):
        cal.observe([0], [0])
    assert cal.observe([1], [1]) is None  # 1 of 9 tests: alpha 0.11, 1.11 / 1.2 < RESUME_AT (and PAUSE_BELOW)
    assert cal.paused


@pytest.mark.parametrize("batch", [1, 2])
def test_auto_paused_is_plain_decoding_and_its_probes_catch_the_draft_up(monkeypatch, batch):
    """Paused (forced here: PAUSE_BELOW and RESUME_AT above any speedup), the loop decodes with the target alone, emitting one
    token per forward, and every PROBE_EVERY iterations drafts resume_gamma tokens. The draft is the target: a probe's
    drafts are all accepted exactly when the draft was fed every token emitted while paused (its first forward of
    the probe takes them all at once), so alpha stays 1. Output is model.generate's; one host read per iteration."""
    from helpers.host_reads import CountHostReads

    monkeypatch.setattr(gamma_mod, "PAUSE_BELOW", 100.0)
    monkeypatch.setattr(gamma_mod, "RESUME_AT", 100.0)
    target = llama()
    ids = _prompt(batch=batch, length=7)
    mask = torch.ones_like(ids)
    if batch == 2:
        mask[1, :3] = 0
    new = 110  # (calibration 26 tokens, then 16 plain + a probe of up to 17, twice at least)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
    session = sk.SpeculativeDecoder(target, target, num_speculative_tokens="auto").start(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    gammas = []
    while not session.finished:
        with CountHostReads() as counter:
            session.step()
        assert counter.reads == ["tolist"]
        gammas.append(session.loop.gamma)
    assert torch.equal(session.sequences(), expected)
    stats = session.stats
    calibration = gamma_mod.CALIBRATION_WARMUP + gamma_mod.CALIBRATION_ITERATIONS
    assert gammas[:calibration] == [gamma_mod.CALIBRATION_GAMMA] * calibration
    probes = [g for g in gammas[calibration:] if g > 0]
    assert len(probes) >= 2 and stats.num_speculative_tokens == 0
    assert gammas[calibration : calibration + gamma_mod.PROBE_EVERY + 1] == [0] * gamma_mod.PROBE_EVERY + probes[:1]
    assert stats.accept_tests_passed == stats.accept_tests > 4 * batch * gamma_mod.CALIBRATION_ITERATIONS
    assert stats.draft_forwards == 4 * calibration + sum(probes)


def test_auto_paused_serves_joining_requests(monkeypatch):
    """Requests joining a batch whose "auto" is paused: each is model.generate alone, and the probes' drafts (the
    draft is the target) are all accepted, the joining rows' pending inputs padded to the batch's."""
    monkeypatch.setattr(gamma_mod, "PAUSE_BELOW", 100.0)
    monkeypatch.setattr(gamma_mod, "RESUME_AT", 100.0)
    target = llama()
    decoder = sk.SpeculativeDecoder(target, target, num_speculative_tokens="auto", max_batch_size=4)
    prompts = {0: [5, 6, 7, 8, 9, 10], 12: [11, 12, 13], 30: [20, 21, 22, 23, 24], 41: [30, 31]}
    news = {0: 90, 12: 40, 30: 50, 41: 25}
    requests, streamed, step = {}, {}, 0
    while step == 0 or decoder.has_work():
        if step in prompts:
            rid = decoder.add_request(prompts[step], max_new_tokens=news[step], do_sample=False, eos_token_id=None)
            requests[rid] = step
        for rid, tokens in decoder.step().items():
            streamed.setdefault(rid, []).extend(tokens)
        step += 1
    for rid, arrival in requests.items():
        ids = torch.tensor([prompts[arrival]])
        alone = target.generate(ids, max_new_tokens=news[arrival], do_sample=False, eos_token_id=None)
        assert streamed[rid] == alone[0, ids.shape[1]:].tolist(), arrival
        result = decoder.result(rid)
        assert result.accepted_tokens <= result.drafted_tokens
    results = [decoder.result(rid) for rid in requests]
    assert sum(r.drafted_tokens for r in results) == sum(r.accepted_tokens for r in results) > 0


def test_the_warmup_iteration_time_is_not_measured():
    """One warm-up and one timed iteration: c is the timed one's alone (a median over [25, 0.1] was 12.55)."""
    cal = GammaCalibrator(start_gamma=4, warmup=1, iterations=1)
    assert cal.record([4], draft_seconds=100.0, verify_seconds=1.0) is None
    cal.record([4], draft_seconds=0.4, verify_seconds=1.0)
    assert cal.c == pytest.approx(0.1) and len(cal.draft_seconds) == len(cal.verify_seconds) == 1


def test_a_recheck_keeps_gamma_when_the_best_is_less_than_the_margin_faster():
    """Chosen 3 at c = 0.1; acceptance 1 of 3 per iteration (alpha 0.5) makes 2 the best, only 1.1% faster:
    below RECHECK_MARGIN, no switch."""
    cal = GammaCalibrator(start_gamma=3)
    cal.chosen, cal.c = 3, 0.1
    assert choose_gamma(0.5, 0.1) == 2
    assert 1 < expected_speedup(0.5, 2, 0.1) / expected_speedup(0.5, 3, 0.1) < 1 + gamma_mod.RECHECK_MARGIN
    for _ in range(gamma_mod.RECHECK_EVERY):
        assert cal.observe([1], [3]) is None
    assert cal.chosen == 3


def test_auto_with_a_checkpoints_static_cache_says_where_it_comes_from():
    """A generation_config with cache_implementation="static" and a call with "auto": the refusal named a static
    cache and compile=True the caller never passed; it says now that the cache is the checkpoint's and how to use the
    dynamic one, with which the call runs (model.generate's tokens)."""
    target = llama()
    target.generation_config.cache_implementation = "static"
    with pytest.raises(ValueError, match=r"static cache \(cache_implementation='static' from the model's "
                                         r"generation_config; pass cache_implementation='dynamic'"):
        sk.generate(target, _prompt(), draft_model=target, num_speculative_tokens="auto", max_new_tokens=5)
    with pytest.raises(ValueError, match=r"^compile=True needs a fixed num_speculative_tokens"):
        sk.generate(llama(), _prompt(), draft_model=target, num_speculative_tokens="auto", max_new_tokens=5,
                    compile=True)
    got = sk.generate(target, _prompt(), draft_model=target, num_speculative_tokens="auto", max_new_tokens=5,
                      cache_implementation="dynamic")
    assert torch.equal(got, target.generate(_prompt(), max_new_tokens=5, do_sample=False))


def test_a_pause_feeds_the_draft_no_tokens_for_rows_finished_before():
    """While "auto" pauses (gamma 0), every iteration appends each row's new token to the draft's pending inputs.
    A row that finished before (kept in the batch: BatchingOptions(drop_finished_fraction=None), or the default's
    tolerance) emits nothing, and its column was fed as a real token: over a pause its draft positions ran past its
    end, and past a learned position table the request was checked against (GPT-2: IndexError in the draft's
    position embedding at the next probe, found by the pause hunt; model.generate runs). Its column is a hole now:
    after 30 such iterations the finished row's positions have not moved, and the other row drafts what the draft
    alone gives on its true sequence."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers.models import SPECIAL
    from speculative_kernels.generation.capabilities import check_model
    from speculative_kernels.generation.drafter import ModelDrafter
    from speculative_kernels.generation.runners.decoder import DecoderRunner
    from speculative_kernels.generation.vocab import VocabBridge

    torch.manual_seed(0)
    draft = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=40,
                                       **SPECIAL)).eval()
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    runner = DecoderRunner(draft, check_model(draft, target=False), 2, 64, torch.device("cpu"))
    drafter = ModelDrafter(runner, VocabBridge(draft, draft), torch.float32, keep_logits=False)
    finished = torch.tensor([True, False])
    row = prompts[1].tolist()
    with torch.inference_mode():
        drafter.start(prompts, torch.ones_like(prompts, dtype=torch.bool))
        for step in range(30):  # row 0 finished before the pause: its out is -1 (it emits nothing)
            token = 20 + step % 50
            row.append(token)
            drafter.observe(torch.tensor([[-1], [token]]), None, finished)
        tokens, _, _ = drafter.propose(2, lambda logits, i: logits.argmax(-1))
        expected = draft(torch.tensor([row])).logits[0, -1].argmax()
    # row 0: its 4 prompt tokens and the first draft step's input (the second's was never fed), none of the 30
    assert runner.next_position.tolist() == [4 + 1, 4 + 30 + 1]
    assert int(tokens[1, 0]) == int(expected)
