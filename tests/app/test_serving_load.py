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
    assert '"continuous"' in capsys.readouterr().out
