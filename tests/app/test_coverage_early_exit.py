"""Smoke test of benchmarks/coverage_early_exit.py (the early-exit sweep that docs/drafting_without_a_model.md
quotes): it runs, tells exact from refused, and its summary fails on a defect."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "coverage_early_exit.py"


def test_the_sweep_runs_and_classifies(tmp_path):
    out = tmp_path / "ee.jsonl"
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "llama,t5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {row["model_type"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert all(rows["llama"][cell].startswith("exact") for cell in ("batch1", "batch2", "batch2_static"))
    assert rows["t5"]["batch1"].startswith("refused: ValueError: assistant_early_exit is supported for decoder-only")
    assert "2 architectures, 6 cells" in done.stdout


def test_the_summary_fails_on_a_defect(tmp_path):
    sweep = tmp_path / "ee.jsonl"
    sweep.write_text(json.dumps({"model_type": "x", "batch1": "DIFFERENT", "batch2": "exact (acceptance 0.5)",
                                 "batch2_static": "refused: ValueError: no"}) + "\n")
    done = subprocess.run([sys.executable, str(SCRIPT), "--summary", str(sweep)], capture_output=True, text=True)
    assert done.returncode == 1 and "x batch1: DIFFERENT" in done.stdout
