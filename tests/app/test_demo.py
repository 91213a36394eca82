"""``speculative-kernels demo --quick`` on the bundled pair: greedy outputs identical, exit status 0 (no timing
assertions). Also: a greedy mismatch makes it exit 1."""

import pytest
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


def _saved_t5_pair(root):
    from transformers import T5Config, T5ForConditionalGeneration

    from helpers.checkpoints import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    for name, layers in (("target", 2), ("draft", 1)):
        torch.manual_seed(layers)
        config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
                          pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)
        T5ForConditionalGeneration(config).eval().save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


def test_demo_counts_an_encoder_decoder_pairs_tokens_from_the_decoder_start(tmp_path, monkeypatch, capsys):
    """A T5 --target/--draft: the outputs start from the decoder start token, not with the prompt. The demo cut the
    prompt's length off them: too few tokens were counted (none, and a ZeroDivisionError in the report, with a
    prompt longer than the completion), and a greedy difference in the first tokens was not seen."""
    target, draft = _saved_t5_pair(tmp_path)
    args = ["demo", "--no-progress", "--target", str(target), "--draft", str(draft),
            "--prompt", "def add(a, b): return", "--max-new-tokens", "12", "--repeats", "1"]
    threads = torch.get_num_threads()
    try:
        code = main(args)
        out = capsys.readouterr().out
        assert code == 0 and "--- model.generate: 12 tokens" in out and "greedy outputs: identical" in out, out
        real_generate = speculative_kernels.generate

        def first_token_changed(*args, **kwargs):
            out = real_generate(*args, **kwargs).clone()
            out[0, 1] = (out[0, 1] + 1) % 90
            return out

        monkeypatch.setattr(speculative_kernels, "generate", first_token_changed)
        code = main(args)
    finally:
        torch.set_num_threads(threads)
    assert code == 1 and "greedy outputs: DIFFER" in capsys.readouterr().out


def test_demo_empty_prompt_starts_from_the_bos_token(tmp_path, capsys):
    """--prompt "" with a --target whose tokenizer adds no BOS: both runs start from the BOS token, as the generate
    command's do (model.generate failed on the empty prompt: "cannot reshape tensor of 0 elements")."""
    from helpers.checkpoints import save_decoder_pair

    target, draft = save_decoder_pair(tmp_path)
    threads = torch.get_num_threads()
    try:
        code = main(["demo", "--no-progress", "--target", str(target), "--draft", str(draft), "--prompt", "",
                     "--max-new-tokens", "5", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0 and "--- model.generate: 5 tokens" in out and "greedy outputs: identical" in out, out


def test_median_run_pairs_each_runs_tokens_with_its_own_time():
    """Sampled repeats stop at their own EOS: the rate is one run's tokens over its own seconds (the last repeat's
    tokens over the median time gave 250 tokens/s for runs of exactly 100)."""
    from speculative_kernels.timing import median_run

    tokens, seconds = [60, 24, 9, 16, 60], [0.6, 0.24, 0.09, 0.16, 0.6]  # every run 100 tokens/s
    i = median_run(tokens, seconds)
    assert tokens[i] / seconds[i] == 100.0
    assert median_run([10, 10, 10], [3.0, 1.0, 2.0]) == 2  # same lengths: the median time
    assert median_run([10, 10], [1.0, 2.0]) == 1  # of the middle two, the slower


def test_demo_rates_under_sampling_are_per_run(monkeypatch):
    """demo._run_prompt under sampling, with a clock that makes every run exactly 100 tokens/s: both paths report
    100 tokens/s (each path's tokens and seconds come from one run), so the speedup is 1."""
    import argparse

    from speculative_kernels import demo, timing
    from speculative_kernels.demo_pair import load_demo_pair

    target, draft, tokenizer = load_demo_pair()
    prompt = "def add(a, b):"
    prompt_length = tokenizer(prompt, return_tensors="pt")["input_ids"].shape[1]
    lengths = iter([60, 60, 24, 42, 9, 48, 16, 60, 60, 60])  # the runs' new tokens (baseline, speculative, ...)

    def fake_timed(fn, device):
        out = fn()[:, : prompt_length + next(lengths)]
        return out, (out.shape[1] - prompt_length) / 100.0

    monkeypatch.setattr(timing, "timed_generate", fake_timed)
    args = argparse.Namespace(max_new_tokens=60, temperature=1.0, top_k=0, top_p=None, min_p=None,
                              repetition_penalty=None, no_repeat_ngram_size=None, gamma=4, seed=0, device="cpu",
                              backend="auto", repeats=5)
    result = demo._run_prompt(prompt, (target, draft, tokenizer, tokenizer), args,
                              demo.Progress(10, enabled=False), 1, 1)
    assert result.baseline_tokens / result.baseline_s == pytest.approx(100.0)
    assert result.speculative_tokens / result.speculative_s == pytest.approx(100.0)
    total = demo.summarize([result])
    assert total["speedup"] == pytest.approx(1.0)


def test_demo_summary_alpha_pools_the_accept_tests():
    """The summary's alpha is the runs' accept tests pooled, the per-prompt line's alpha for one prompt (it read the
    histogram as one gamma: with gamma auto, calibration iterations accepting 4 of 4 counted as failures at 6)."""
    from speculative_kernels import SpeculationStats
    from speculative_kernels.demo import PromptResult, summarize

    stats = SpeculationStats(num_speculative_tokens=6, target_forwards=13, drafted_tokens=54, accepted_tokens=46,
                             new_tokens=59, accepted_histogram=[2, 1, 1, 3, 2, 0, 4], accept_tests=54,
                             accept_tests_passed=46)
    result = PromptResult(prompt="p", baseline_text="", speculative_text="", baseline_tokens=59,
                          speculative_tokens=59, baseline_s=1.0, speculative_s=1.0, stats=stats, identical=True)
    assert summarize([result])["alpha"] == stats.alpha == 46 / 54
