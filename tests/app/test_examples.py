"""The examples in python/ run as the README says (``python python/NAME.py``) and print what they claim: they are
run here in-process (``runpy``, as ``__main__``), so an API change that breaks one fails the suite."""

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "python"


def _run(name: str, capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name)])
    monkeypatch.syspath_prepend(str(EXAMPLES))  # (the examples import their _tiny_pair helper)
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.parametrize("name,claims", [
    ("hf_dropin.py", ["greedy identical to model.generate: True", "batched identical: True", "stats: acceptance"]),
    ("own_drafter.py", ["greedy identical to model.generate: True", "sampled (exactly the target's distribution)"]),
    ("ops_direct.py", ["emitted tokens (-1 = padding)", "greedy:", "backend torch:"]),
    ("serving_loop.py", ["req-a: 'def fibonacci(n):' -> ", "req-c: 'for line in' -> ", "iterations; acceptance"]),
])
def test_example_runs_and_prints_its_claims(name, claims, capsys, monkeypatch):
    out = _run(name, capsys, monkeypatch)
    for claim in claims:
        assert claim in out, (claim, out)
    assert "False" not in out, out


@pytest.mark.parametrize("name", ["hf_dropin.py", "own_drafter.py"])
def test_example_runs_on_a_users_folders(name, capsys, monkeypatch, tmp_path):
    """``--target DIR --draft DIR``: prompts come from the folders' tokenizer (the tiny pair's ids, up to 99, are past
    this pair's 97-token vocabulary)."""
    from helpers.checkpoints import save_decoder_pair

    target, draft = save_decoder_pair(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), "--target", str(target), "--draft", str(draft)])
    monkeypatch.syspath_prepend(str(EXAMPLES))
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out
    assert "greedy identical to model.generate: True" in out and "False" not in out, out
