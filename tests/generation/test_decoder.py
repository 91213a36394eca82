"""The server-facing decoder object: step-by-step tokens equal generate's output."""

import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama


def test_session_steps_reproduce_generate():
    target, draft = llama(), llama(layers=1, seed=2)
    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(1))
    expected = target.generate(ids, max_new_tokens=15, do_sample=False, pad_token_id=0)
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        ids, max_new_tokens=15, do_sample=False, pad_token_id=0)
    streamed = [[] for _ in range(3)]
    while not session.finished:
        for row, tokens in enumerate(session.step()):
            streamed[row].extend(tokens)
    assert torch.equal(session.sequences(), expected)
    assert not session.sequences().is_inference()  # a copy the user may edit or train on, as generate's output
    for row in range(3):
        assert streamed[row] == expected[row, 6:].tolist()
    assert session.stats.target_forwards == session.iterations
    with pytest.raises(RuntimeError, match="finished"):
        session.step()


def test_session_refuses_output_options():
    target = llama()
    with pytest.raises(ValueError, match="streamer"):
        sk.SpeculativeDecoder(target, target).start(torch.ones(1, 3, dtype=torch.int64), streamer=object())


def test_phase_timer_stays_bounded_over_a_long_run():
    """A server's running batch may iterate for hours: the timer folds completed spans into a total (on CUDA it
    kept two events per phase per iteration, forever), keeping the last span of each phase and the same sums."""
    from speculative_kernels.generation.stats import PhaseTimer

    timer, other = PhaseTimer(torch.device("cpu")), PhaseTimer(torch.device("cpu"))
    for _ in range(1000):
        timer.start("step")
        timer.stop("step")
    assert len(timer.spans["step"]) < PhaseTimer.FOLD_AT
    begin, end = timer.spans["step"][-1]
    assert timer.last("step") == end - begin
    total = timer.seconds("step")
    assert total >= timer.last("step") and total == timer.folded["step"] + sum(e - b for b, e in timer.spans["step"])
    other.start("step")
    other.stop("step")
    timer.merge(other)
    # (the same spans summed in another order: equal up to float reassociation)
    assert timer.seconds("step") == pytest.approx(total + other.seconds("step"), rel=1e-9)
    assert timer.last("step") == end - begin
