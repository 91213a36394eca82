"""Smoke test of benchmarks/admission_cost.py on the demo pair: it runs and reports each context's medians (no
timing is asserted), and leaves no request behind."""

import importlib.util
from pathlib import Path

import pytest

from speculative_kernels.demo_pair import demo_model_paths

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "admission_cost.py"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_reports_every_context(cache):
    spec = importlib.util.spec_from_file_location("admission_cost_benchmark", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target, draft = demo_model_paths()
    results = module.main(["--target", str(target), "--draft", str(draft), "--running", "2", "--contexts", "6", "12",
                           "--repeats", "1", "--cache-implementation", cache])
    assert results["cache_implementation"] == cache
    assert set(results["contexts"]) == {6, 12}
    for row in results["contexts"].values():
        assert row["admitting_step_ms"] > 0 and row["plain_step_ms"] > 0
        assert row["admission_ms"] == round(row["admitting_step_ms"] - row["plain_step_ms"], 1)
