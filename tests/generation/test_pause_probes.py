"""While "auto" is paused, a probe drafts ``resume_gamma`` tokens (the best gamma at the latest alpha), and the
statistics' accepted_histogram covers the probe's gamma (mutation round 4: mutants L2, L3, L4, G6 passed every other
test). The other paused tests take the target as its own draft with c measured, where resume_gamma is whatever
timing gives, and never check the probe's width nor the histogram's length: probing at the calibration gamma, a
histogram cut at the largest *chosen* gamma (dropping the probes' full acceptances), or a loop that observes no
probe (every later iteration then probes) passed them."""

import torch

import speculative_kernels as sk
from helpers.models import llama
from speculative_kernels.generation import gamma as gamma_mod
from speculative_kernels.generation.gamma import GammaCalibrator


def test_probes_draft_resume_gamma_and_the_histogram_holds_them(monkeypatch):
    monkeypatch.setattr(gamma_mod, "PAUSE_BELOW", 100.0)  # always paused after calibration
    monkeypatch.setattr(gamma_mod, "RESUME_AT", 100.0)
    monkeypatch.setattr(gamma_mod, "choose_gamma", lambda alpha, c, max_gamma=16: 7)  # resume_gamma 7
    target = llama()
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    new = 80
    expected = target.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None)
    session = sk.SpeculativeDecoder(target, target, num_speculative_tokens="auto").start(
        ids, max_new_tokens=new, do_sample=False, eos_token_id=None)
    gammas = []
    while not session.finished:
        session.step()
        gammas.append(session.loop.gamma)
    assert torch.equal(session.sequences(), expected)
    calibration = gamma_mod.CALIBRATION_WARMUP + gamma_mod.CALIBRATION_ITERATIONS
    probes = [g for g in gammas[calibration:] if g > 0]
    assert probes and probes[0] == 7, gammas  # the first probe is far from the end: not capped
    # 26 tokens in calibration; 16 plain + a probe of 7 (8 tokens) twice reach 74 of 80: a probe is observed (its
    # accept tests join the window and it restarts the count), so the next one is PROBE_EVERY plain iterations later
    plain = [0] * gamma_mod.PROBE_EVERY
    assert gammas[calibration : calibration + 2 * (len(plain) + 1)] == plain + [7] + plain + [7], gammas
    stats = session.stats
    # the draft is the target: every probe accepted all it drafted, so histogram[7] counts the full probes
    assert len(stats.accepted_histogram) == 8, stats.accepted_histogram
    assert stats.accepted_histogram[7] == sum(1 for g in probes if g == 7)
    assert sum(n * k for n, k in enumerate(stats.accepted_histogram)) == stats.accepted_tokens


def test_a_probe_where_one_row_drafted_nothing_is_still_a_probe():
    """While paused, an iteration is a probe when *any* row drafted (a row near its end, or one whose drafter
    proposes nothing, drafts 0 in the probe). Counting it as a plain iteration unless *every* row drafted threw the
    probe's evidence away and left probe_due on."""
    cal = GammaCalibrator(start_gamma=4, warmup=0, iterations=1)
    assert cal.record([0, 0], draft_seconds=2.0, verify_seconds=1.0) == 0  # c 0.5, alpha 0: paused
    for _ in range(gamma_mod.PROBE_EVERY):
        assert cal.observe([0, 0], [0, 0]) is None
    assert cal.probe_due
    # the probe: row 0 drafted 1 and accepted it, row 1 (one token left) drafted nothing
    assert cal.observe([1, 0], [1, 0]) is None  # 1 of 3 tests: 1.33 / 1.5 < RESUME_AT, still paused
    assert not cal.probe_due and cal.since_probe == 0
    assert cal.alpha == 1 / 3 and len(cal.recent) == 2
