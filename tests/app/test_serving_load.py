"""Smoke test of benchmarks/serving_load.py on the tiny pair: the Poisson workload, and both our methods serve every
request its full length (greedy, so they produce the same tokens; continuous batching on both caches); no timing is asserted."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

LOAD_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_load.py"


@pytest.fixture(scope="module")
def load():
    spec = importlib.util.spec_from_file_location("serving_load_benchmark", LOAD_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workload_is_poisson_and_seeded(load):
    requests = load.workload(400, rate=5.0, min_new=4, max_new=9, vocab=97)
    assert requests == load.workload(400, rate=5.0, min_new=4, max_new=9, vocab=97)
    gaps = np.diff([t for t, _, _ in requests])
    assert requests[0][0] == 0.0 and (gaps >= 0).all()
    assert 0.15 < gaps.mean() < 0.25  # mean gap 1 / rate
    assert all(8 <= len(p) <= 32 and 4 <= n <= 9 for _, p, n in requests)


def test_latency_conventions(load):
    """Per token (gap / k, k times), per chunk (the gap once: vLLM's ITL) and per request (vLLM's TPOT)."""
    recorder = load.Recorder([(0.0, [1], 5), (0.0, [2], 2)])
    for now, tokens in ((1.0, [7]), (3.0, [7, 7, 7, 7])):  # first token at 1 s, then 4 tokens 2 s later
        recorder.emit(0, now, tokens)
    recorder.emit(1, 2.0, [5, 6])  # one chunk of 2: no gap, TPOT 0
    summary = load.Recorder.summary(recorder, 0.0, 4.0)
    assert summary["new_tokens"] == 7 and recorder.tokens == {0: [7] * 5, 1: [5, 6]}
    assert summary["itl_ms_p50"] == 500.0 and summary["itl_chunk_ms_p50"] == 2000.0
    assert summary["tpot_ms_p99"] == pytest.approx(495.0)  # TPOTs 500 ms and 0 ms: p99 by linear interpolation
    assert summary["ttft_ms_p50"] == 1500.0


def test_methods_serve_every_token(load, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = load.main(["--tiny", "--requests", "6", "--rate", "50", "--min-new", "3", "--max-new", "9",
                             "--methods", "continuous", "continuous_static", "static", "--no-warm-up"])
    finally:
        torch.set_num_threads(threads)
    requests = load.workload(6, 50.0, 3, 9, 512)
    expected = sum(n for _, _, n in requests)
    for method in ("continuous", "continuous_static", "static"):
        summary = results["methods"][method]
        assert summary["new_tokens"] == expected, method
        assert summary["ttft_ms_p50"] is not None and summary["itl_ms_p99"] is not None
        assert summary["itl_chunk_ms_p99"] is not None and summary["tpot_ms_p99"] is not None
    assert results["identical_to_generate"] == {"continuous": True, "continuous_static": True, "static": True}
    assert '"continuous"' in capsys.readouterr().out
    assert results["first_differences"] == {}


def test_first_difference_reports_the_reference_logits_there(load):
    """A method's first departure from model.generate: the step, both tokens, and the gap between their logits in
    model.generate's own step, in units of the model dtype's spacing at the chosen logit (a near-tie or not)."""
    logits = [torch.tensor([0.0, 5.0, 1.0]), torch.tensor([3.0, 0.0, 2.984375])]  # step 1: tokens 0 and 2
    record = load.first_difference(4, [1, 0, 2], [1, 2, 2], logits, torch.bfloat16)
    assert record["request"] == 4 and record["step"] == 1
    assert record["expected_token"] == 0 and record["got_token"] == 2
    assert record["gap"] == pytest.approx(0.015625)
    assert record["gap_in_spacings"] == pytest.approx(1.0)  # bf16 spacing in [2, 4): 2^1 * 2^-7
    shorter = load.first_difference(0, [1, 0], [1], logits, torch.bfloat16)  # stopped early: no token to compare
    assert shorter["step"] == 1 and "gap" not in shorter
