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
