"""``speculative-kernels demo --quick`` on the bundled pair: greedy outputs identical, exit status 0 (no timing
assertions). Also: a greedy mismatch makes it exit 1."""

import torch

import speculative_kernels
from speculative_kernels.cli import main


def test_demo_quick_greedy_outputs_identical(capsys):
    threads = torch.get_num_threads()
    try:
        code = main(["demo", "--quick", "--no-progress", "--device", "cpu", "--gamma", "4"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "greedy outputs: identical" in out
    assert out.count("--- outputs identical") == 2  # both quick prompts
    assert "speedup" in out and "acceptance rate" in out and "tokens per target forward" in out


def test_demo_auto_gamma_and_custom_prompt(capsys):
    threads = torch.get_num_threads()
    try:
        code = main(["demo", "--no-progress", "--gamma", "auto", "--max-new-tokens", "12", "--repeats", "1",
                     "--prompt", "def add(a, b):\n"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "=== prompt 1/1" in out and "def add(a, b):" in out and "gamma auto -> " in out


def test_demo_exits_nonzero_when_greedy_outputs_differ(monkeypatch, capsys):
    real_generate = speculative_kernels.generate

    def corrupted(*args, **kwargs):
        out = real_generate(*args, **kwargs).clone()
        out[0, -1] = (out[0, -1] + 1) % 100
        return out

    monkeypatch.setattr(speculative_kernels, "generate", corrupted)
    threads = torch.get_num_threads()
    try:
        code = main(["demo", "--quick", "--no-progress", "--max-new-tokens", "8"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 1
    assert "greedy outputs: DIFFER" in out and "(ERROR: greedy)" in out


def test_demo_checks_identity_in_float32_unless_told():
    """The demo's greedy identity check is exact in float32 (half precision: docs/half_precision.md), so 'auto' means
    float32 on every device; an explicit dtype is kept."""
    from speculative_kernels.demo import _demo_dtype

    assert _demo_dtype("auto", "cpu") == _demo_dtype("auto", "cuda") == "float32"
    assert _demo_dtype("bfloat16", "cuda") == "bfloat16"


def test_demo_runs_a_pair_whose_vocabularies_differ_by_padding(tmp_path, capsys):
    """--target/--draft whose vocab_size differ (128 vs 112) with one shared tokenizer: generate accepts them when
    given both tokenizers; the demo's warm-up passed neither and refused the pair ("different vocabularies")."""
    from helpers.checkpoints import tiny_tokenizer
    from helpers.models import llama

    tokenizer = tiny_tokenizer()
    for name, model in (("target", llama(layers=2, vocab=128, seed=0)), ("draft", llama(layers=1, vocab=112, seed=1))):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    threads = torch.get_num_threads()
    try:
        code = main(["demo", "--no-progress", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                     "--prompt", "for i in", "--max-new-tokens", "6", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0 and "greedy outputs: identical" in out, out
