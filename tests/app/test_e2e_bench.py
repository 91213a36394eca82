"""Smoke test of benchmarks/e2e.py on tiny random models: the controlled-acceptance construction and the CLI."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import speculative_kernels as sk

E2E_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "e2e.py"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and threads thrash on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_benchmark", E2E_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _synthetic(e2e, alpha):
    return e2e.synthetic_pair(alpha, "tiny-target", "tiny-draft", torch.device("cpu"), torch.float32, seed=3)


def test_target_greedy_choice_is_the_cycle(e2e):
    target, _ = _synthetic(e2e, 0.5)
    control = e2e.ControlledAcceptance(target.config.vocab_size, 0.5, "cpu", seed=3)
    ids = torch.tensor([[5, 9, 11]])
    out = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    expected, token = [], 11
    for _ in range(12):
        token = int(control.target_next[token])
        expected.append(token)
    assert out == expected
    assert len(set(control.target_next.tolist())) == target.config.vocab_size  # a permutation ...
    seen, token = set(), 0
    for _ in range(target.config.vocab_size):
        seen.add(token)
        token = int(control.target_next[token])
    assert len(seen) == target.config.vocab_size  # ... with a single cycle


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_measured_alpha_follows_the_set_rate(e2e, alpha):
    target, draft = _synthetic(e2e, alpha)
    prompts = e2e.random_prompts(3 if alpha == 0.6 else 1, 8, target.config.vocab_size, "cpu", seed=1)
    gamma = 4
    passed = tests = 0
    for ids in prompts:
        stats = sk.SpeculationStats()
        expected = target.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=0)
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=gamma, max_new_tokens=60,
                          do_sample=False, pad_token_id=0, speculation_stats=stats)
        assert torch.equal(got, expected)
        passed, tests = passed + stats.accept_tests_passed, tests + stats.accept_tests
    estimate = passed / tests
    if alpha in (0.0, 1.0):
        assert estimate == alpha
    else:
        assert abs(estimate - alpha) < 0.12, (estimate, passed, tests)


def test_cli_writes_table_json_and_plot(e2e, tmp_path, capsys):
    argv = ["--synthetic", "--target-shape", "tiny-target", "--draft-shape", "tiny-draft", "--alpha", "0.8",
            "--device", "cpu", "--sweep-gamma", "1,3", "--max-new-tokens", "12", "--prompts", "2", "--repeats", "1",
            "--threads", "1",
            "--out", str(tmp_path), "--name", "smoke"]
    assert e2e.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| synthetic α=0.8" in printed and "efficiency" in printed
    result = json.loads((tmp_path / "smoke.json").read_text())
    rows = result["rows"]
    assert [r["gamma"] for r in rows] == [1, 3]
    for row in rows:
        assert row["case"].startswith("synthetic")
        assert row["identical"] is True
        assert row["identical_by_path"] == {"assisted": True, "ours": True}
        assert 0.0 <= row["alpha"] <= 1.0 and row["c"] > 0
        predicted = e2e.expected_speedup(row["alpha"], row["gamma"], row["c"])
        assert row["predicted_speedup"] == pytest.approx(predicted)
        assert row["efficiency"] == pytest.approx(row["speedup_vs_hf"] / predicted)
        assert row["new_tokens"] == 2 * 12
    if _has_matplotlib():
        assert (tmp_path / "smoke.png").stat().st_size > 0


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_run_paths_rates_are_per_repeat(e2e, monkeypatch):
    """Sampled repeats differ in length: each path's tokens and seconds come from one repeat (the median-rate one),
    so a clock making every run 100 tokens/s gives 100 (the last repeat's tokens over the median time did not)."""
    target, draft = _synthetic(e2e, 0.5)
    lengths = iter([30, 12, 5, 20, 30, 8, 3, 30, 25, 30])  # new tokens of the calls, paths alternating

    def fake_timed(fn, device):
        out = fn()
        keep = next(lengths)
        return out[:, : out.shape[1] - 30 + keep], keep / 100.0

    monkeypatch.setattr(e2e, "timed_generate", fake_timed)
    ids = e2e.random_prompts(1, 8, target.config.vocab_size, "cpu", seed=1)
    kwargs = e2e.generation_kwargs(30, 0.8, pad_token_id=0, eos_token_id=None)
    measured = e2e.run_paths(target, draft, ids, 4, kwargs, repeats=4, paths=("hf", "ours"))
    for path in ("hf", "ours"):
        assert measured["tokens"][path] / measured["seconds"][path] == pytest.approx(100.0)


def test_batching_counts_tokens_to_each_rows_eos():
    """e2e_batching's token count with an EOS: each row up to and including its first EOS; a real token equal to
    the pad id 0 counts (``!= 0`` dropped it)."""
    spec = importlib.util.spec_from_file_location("e2e_batching_benchmark", E2E_PATH.parent / "e2e_batching.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    new = torch.tensor([[4, 0, 7, 2, 0, 0], [5, 6, 7, 8, 9, 1], [2, 0, 0, 0, 0, 0]])
    assert module.new_token_count(new, 2) == 4 + 6 + 1
    assert module.new_token_count(new, [2, 9]) == 4 + 5 + 1
    assert module.new_token_count(new, None) == 18
