"""The console command on a tiny model pair saved to disk with a tokenizer."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from speculative_kernels.cli import main
from helpers.checkpoints import save_decoder_pair
import argparse
from speculative_kernels import cli_options


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_decoder_pair(tmp_path_factory.mktemp("pair"))


def test_generate_compare_greedy(pair, capsys):
    target, draft = pair
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def add(a, b):",
                 "--max-new-tokens", "12", "--gamma", "3", "--compare"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tokens/s" in out and "acceptance rate" in out
    assert "outputs identical" in out


def test_generate_sampling_options(pair, capsys):
    target, draft = pair
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "for i in",
                 "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
                 "--seed", "3", "--dtype", "float32"])
    assert code == 0
    assert "acceptance rate" in capsys.readouterr().out


def test_sampling_options_left_unset_follow_the_checkpoint(pair, tmp_path, capsys):
    """--top-k/--top-p left unset: the checkpoint's generation_config decides, as in model.generate (they forced
    top-k off and top-p 1, silently overriding it). A target whose generation_config says top_k=1 samples its greedy
    continuation at any temperature; --top-k 0 given explicitly turns that off."""
    import transformers

    target, draft = pair
    narrowed = tmp_path / "target-top-k-1"
    shutil.copytree(target, narrowed)
    config = transformers.GenerationConfig.from_pretrained(target)
    config.do_sample, config.top_k = True, 1  # (a sampling checkpoint; the CLI's default --temperature 0 is greedy)
    config.save_pretrained(narrowed)
    args = ["generate", "--target", str(narrowed), "--draft", str(draft), "--prompt", "for i in",
            "--max-new-tokens", "12", "--gamma", "3"]

    def completion(*extra) -> str:
        assert main(args + list(extra)) == 0
        return capsys.readouterr().out.split("\nspeculative:")[0]

    greedy = completion()
    assert all(completion("--temperature", "1.5", "--seed", str(seed)) == greedy for seed in range(3))
    assert any(completion("--temperature", "1.5", "--top-k", "0", "--seed", str(seed)) != greedy for seed in range(3))


def test_gamma_left_unset_is_the_checkpoints_num_assistant_tokens(pair, tmp_path, monkeypatch, capsys):
    """--gamma left unset with --draft: generate's own gamma, a checkpoint's num_assistant_tokens (the target's
    generation_config, as sk.generate and model.generate read it), else 5; --gamma given wins. It was always 5,
    the checkpoint's value silently ignored."""
    import transformers

    import speculative_kernels

    target, draft = pair
    tuned = tmp_path / "target-gamma-2"
    shutil.copytree(target, tuned)
    config = transformers.GenerationConfig.from_pretrained(target)
    config.num_assistant_tokens = 2
    config.save_pretrained(tuned)
    widths = []

    def generate(*args, speculation_stats=None, **kwargs):  # (the histogram has gamma + 1 bins)
        output = real(*args, speculation_stats=speculation_stats, **kwargs)
        if speculation_stats is not None:
            widths.append(len(speculation_stats.accepted_histogram) - 1)
        return output

    real = speculative_kernels.generate  # (the command imports it from the package when it runs)
    monkeypatch.setattr(speculative_kernels, "generate", generate)
    for folder, extra, gamma in ((tuned, [], 2), (tuned, ["--gamma", "3"], 3), (target, [], 5)):
        assert main(["generate", "--target", str(folder), "--draft", str(draft), "--prompt", "x",
                     "--max-new-tokens", "12", *extra]) == 0
        assert widths.pop() == gamma, (folder.name, extra)
    capsys.readouterr()


def test_logits_processor_options(pair, capsys):
    """--repetition-penalty/--no-repeat-ngram-size (greedy: identical to model.generate with them), --min-p when
    sampling; --min-p with greedy decoding is a usage error, as --top-k is."""
    target, draft = pair
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def add(a, b):",
                 "--max-new-tokens", "12", "--gamma", "3", "--repetition-penalty", "1.3", "--no-repeat-ngram-size",
                 "2", "--compare"])
    assert code == 0 and "outputs identical" in capsys.readouterr().out
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "for i in",
                 "--max-new-tokens", "8", "--temperature", "0.8", "--min-p", "0.05", "--seed", "3"])
    assert code == 0
    capsys.readouterr()
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--min-p", "0.1"]) == 2
    assert "--min-p" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x",
              "--repetition-penalty", "0"])


def test_missing_folder_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--target", str(tmp_path / "nope"), "--draft", str(tmp_path), "--prompt", "x"])
    assert code == 2
    assert "model folder not found" in capsys.readouterr().err


def test_console_script_runs():
    """The installed entry point reaches the CLI's parser (its generation runs in process in the tests around; CI's
    side job runs the console script's whole demo, ``speculative-kernels demo --quick``, in a fresh process: a
    generation here took ~7-14 s of CI, most of it importing torch and transformers)."""
    exe = shutil.which("speculative-kernels")
    cmd = [exe] if exe else [sys.executable, "-m", "speculative_kernels.cli"]
    result = subprocess.run(cmd + ["generate", "--help"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr
    assert "--target" in result.stdout and "--compare" in result.stdout


def test_empty_prompt_counts_only_new_tokens(pair, capsys):
    """--prompt "" starts from the BOS token explicitly: 5 new tokens are reported as 5 (it said 6), and --compare
    runs model.generate on the same one-token prompt (it ended in a traceback)."""
    target, draft = pair
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "", "--max-new-tokens", "5",
                 "--compare"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "speculative: 5 tokens" in out and "model.generate: 5 tokens" in out and "outputs identical" in out


def test_acceptance_figures_are_explained(pair, capsys):
    target, draft = pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--max-new-tokens",
                 "12", "--gamma", "2"]) == 0
    out = capsys.readouterr().out
    assert "acceptance rate" in out and "alpha" in out and "accepted drafts / drafted tokens" in out


def test_undefined_acceptance_figures_are_said_not_zero(pair, capsys):
    """max_new_tokens=1: the token comes from the prefill, nothing is drafted. Zeros would read as every draft
    rejected."""
    target, draft = pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--max-new-tokens",
                 "1", "--gamma", "4"]) == 0
    out = capsys.readouterr().out
    assert "nothing drafted" in out and "alpha 0.000" not in out


def test_acceptance_figures_of_shortened_iterations(pair, capsys):
    """max_new_tokens=3 at gamma 4: every iteration drafts fewer than gamma (the tokens left less one). They count:
    alpha and tokens per target forward are given (they were "n/a", with a reason that is wrong for prompt lookup,
    whose iterations are short because its proposals are)."""
    from speculative_kernels import SpeculationStats

    target, draft = pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--max-new-tokens",
                 "3", "--gamma", "4"]) == 0
    out = capsys.readouterr().out
    assert "n/a" not in out and "alpha " in out and " tokens per target forward" in out
    from speculative_kernels.cli import speculation_figures

    stats = SpeculationStats(target_forwards=2, drafted_tokens=2, accepted_tokens=1, new_tokens=3,
                             accepted_histogram=[1, 1], accept_tests=2, accept_tests_passed=1)
    assert speculation_figures(stats, False) == "acceptance rate 0.500, alpha 0.500, 1.50 tokens per target forward"


def test_an_unexpected_failure_has_its_own_exit_status(pair, capsys, monkeypatch):
    """A failure that is neither a usage error (2) nor a difference (--compare's 1) exits 3 with its traceback."""
    import speculative_kernels

    def broken(*args, **kwargs):
        raise RuntimeError("a defect")

    monkeypatch.setattr(speculative_kernels, "generate", broken)  # (the command imports it when it runs)
    target, draft = pair
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--max-new-tokens",
                 "2", "--compare"])
    err = capsys.readouterr().err
    assert code == 3 and "RuntimeError: a defect" in err and "Traceback" in err


def test_help_imports_neither_torch_nor_transformers():
    """--help parses before anything heavy is imported (it took 5-6 s)."""
    code = ("import sys; from speculative_kernels.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_demo_help_is_plain_text_with_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "``" not in out and "(default: 96)" in out and "(default: 4)" in out


def test_generate_with_prompt_lookup_needs_no_draft(pair, capsys):
    target, _ = pair
    code = main(["generate", "--target", str(target), "--prompt-lookup", "4", "--max-ngram", "3",
                 "--prompt", "def add(a, b): return a + b\ndef add(a, b):", "--max-new-tokens", "12", "--compare"])
    out = capsys.readouterr().out
    assert code == 0
    assert "outputs identical" in out


def test_generate_with_the_targets_first_layers_needs_no_draft(pair, capsys):
    target, _ = pair
    code = main(["generate", "--target", str(target), "--early-exit", "1", "--gamma", "3",
                 "--prompt", "def add(a, b): return a + b", "--max-new-tokens", "12", "--compare"])
    out = capsys.readouterr().out
    assert code == 0 and "outputs identical" in out and "acceptance rate" in out


@pytest.mark.parametrize("drafting", [[], ["--draft", "DRAFT", "--prompt-lookup", "3"],
                                      ["--draft", "DRAFT", "--early-exit", "1"]])
def test_exactly_one_of_draft_and_prompt_lookup(pair, capsys, drafting):
    target, draft = pair
    drafting = [str(draft) if a == "DRAFT" else a for a in drafting]
    code = main(["generate", "--target", str(target), "--prompt", "x", *drafting])
    assert code == 2
    assert "pass exactly one of --draft" in capsys.readouterr().err


def _completion(pair, capsys, seed: str) -> str:
    target, draft = pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "for i in",
                 "--max-new-tokens", "10", "--temperature", "1.0", "--seed", seed, "--dtype", "float32"]) == 0
    return capsys.readouterr().out.split("\nspeculative:")[0]


def test_seed_replays_the_run(pair, capsys):
    """--seed is generate(seed=...): the same seed prints the same completion whatever torch's global generator
    holds; another seed prints another one (10 tokens from a random model's near-uniform distributions)."""
    import torch

    first = _completion(pair, capsys, "3")
    torch.manual_seed(12345)
    assert _completion(pair, capsys, "3") == first
    assert _completion(pair, capsys, "4") != first


def test_bad_seed_is_an_argument_error(pair, capsys):
    target, draft = pair
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--seed", "-1"])
    assert exit_info.value.code == 2
    assert "--seed: must be in [0, 2**63), got -1" in capsys.readouterr().err


def test_describe_difference_reports_the_near_tie():
    """--compare's report where greedy outputs part: each side's margin for its token and how far apart the two
    computations of those logits are, in the dtype's rounding at their scale."""
    import types

    import torch

    from speculative_kernels.cli import describe_difference

    def run(last):
        def fn(output_logits, return_dict_in_generate):  # (re-run as the run was: no shorter max_new_tokens)
            assert output_logits and return_dict_in_generate
            sequence = torch.tensor([[5, 3, 3, int(last.argmax())]])  # a prompt token, then the 3 new ones
            return types.SimpleNamespace(logits=[torch.zeros(1, 4, dtype=torch.bfloat16)] * 2 + [last[None]],
                                         sequences=sequence)
        return fn

    ours = torch.tensor([8.0, 1.0, 8.0625, 0.0], dtype=torch.bfloat16)  # prefers token 2 by one bf16 step
    theirs = torch.tensor([8.0625, 1.0, 8.0, 0.0], dtype=torch.bfloat16)
    text = describe_difference(2, run(ours), run(theirs), torch.bfloat16, (2, 0))
    assert "new token 2: ours 2, model.generate 0" in text
    assert "prefer its token by 0.0625" in text and "ours prefer ours by 0.0625" in text
    # spread 0.0625 at scale 8.0625: bf16's rounding there is 2**-8 * 8.0625 = 0.0315 -> 2.0 roundings
    assert "differ by up to 0.0625 = 2.0 x torch.bfloat16's rounding" in text
    # a re-run that does not emit the tokens being explained is said so, not described as if it did (a re-run
    # shortened to step + 1 tokens used to draft fewer tokens there and could round the other way in half precision)
    text = describe_difference(2, run(theirs), run(theirs), torch.bfloat16, (2, 0))
    assert "does not reproduce" in text and "exact tie" not in text

    def short(output_logits, return_dict_in_generate):
        return types.SimpleNamespace(logits=[torch.zeros(1, 4)], sequences=torch.tensor([[5, 1]]))

    assert "differ in length" in describe_difference(2, short, run(theirs), torch.float32)


def test_an_image_text_checkpoint_generates_from_text(tmp_path, capsys):
    """A Qwen2-VL folder (an image-text-to-text class, in no causal-LM mapping): loaded with
    AutoModelForImageTextToText, as the Python API drives it; it was an error ("Unrecognized configuration class")."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from helpers.checkpoints import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2, spatial_merge_size=1)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    code = main(["generate", "--target", str(tmp_path), "--prompt-lookup", "3", "--prompt", "for i in",
                 "--max-new-tokens", "8", "--compare"])
    assert code == 0 and "outputs identical" in capsys.readouterr().out


def _with_generation_config(source, destination, **fields):
    """A copy of checkpoint folder ``source`` whose generation_config.json also sets ``fields``; its tokenizer
    decodes byte-level tokens back to text (HF's stop-string matching needs that)."""
    import transformers
    from tokenizers import decoders

    shutil.copytree(source, destination)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save_pretrained(destination)
    config = transformers.GenerationConfig.from_pretrained(source)
    for name, value in fields.items():
        setattr(config, name, value)
    config.save_pretrained(destination)
    return destination


@pytest.mark.parametrize("drafting", [["--draft", "DRAFT"], ["--prompt-lookup", "3"]])
def test_a_checkpoints_stop_strings_are_honoured_on_both_paths(pair, tmp_path, capsys, drafting):
    """A target whose generation_config sets stop_strings: both runs get the tokenizer that HF's stop-string
    matching needs, and stop at the same token (--prompt-lookup failed: "stop_strings needs tokenizer="; with
    --draft, --compare's model.generate failed: "could not locate a tokenizer")."""
    import torch
    import transformers

    target, draft = pair
    drafting = [str(draft) if a == "DRAFT" else a for a in drafting]
    plain = _with_generation_config(target, tmp_path / "plain")
    model = transformers.AutoModelForCausalLM.from_pretrained(plain)
    tokenizer = transformers.AutoTokenizer.from_pretrained(plain)
    ids = tokenizer("for i in", return_tensors="pt")["input_ids"]
    new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    # the text of a new token past the first two (not a piece of a UTF-8 character): the run stops there at the latest
    position, stop = next((i, text) for i, text in ((i, tokenizer.decode(new[i:i + 1])) for i in range(2, 11))
                          if text.strip() and "\ufffd" not in text)
    stopping = _with_generation_config(target, tmp_path / "stopping", stop_strings=[stop])
    code = main(["generate", "--target", str(stopping), "--prompt", "for i in", "--max-new-tokens", "12", "--compare",
                 *drafting])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0 and "outputs identical" in out, (out, captured.err, stop)
    count = int(out.split("\nspeculative: ")[1].split(" tokens")[0])
    assert count <= position + 1 and tokenizer.decode(new[:count]).endswith(stop)


def test_a_checkpoint_asking_for_a_dict_output_runs(pair, tmp_path, capsys):
    """A generation_config with return_dict_in_generate (and output_scores): both generate calls return a dict
    output, whose sequences are read (it ended with "error: tuple indices must be integers or slices, not tuple")."""
    target, draft = pair
    folder = _with_generation_config(target, tmp_path / "dict", return_dict_in_generate=True, output_scores=True)
    code = main(["generate", "--target", str(folder), "--draft", str(draft), "--prompt", "for i in",
                 "--max-new-tokens", "6", "--compare"])
    out = capsys.readouterr().out
    assert code == 0 and "speculative: 6 tokens" in out and "outputs identical" in out, out


def test_a_checkpoint_asking_for_several_sequences_is_refused_by_name(pair, tmp_path, capsys):
    """num_return_sequences=2 in the generation_config (a sampling checkpoint): the command prints one completion,
    so it refuses by name; it generated both rows, printed row 0 and counted only its tokens in tokens/s."""
    target, draft = pair
    folder = _with_generation_config(target, tmp_path / "two", do_sample=True, num_return_sequences=2)
    code = main(["generate", "--target", str(folder), "--draft", str(draft), "--prompt", "for i in",
                 "--max-new-tokens", "4", "--temperature", "1"])
    assert code == 2 and "num_return_sequences=2" in capsys.readouterr().err


def test_a_checkpoints_beam_search_and_invalid_pad_id_are_replaced_with_a_note(pair, tmp_path, capsys):
    """A generation_config with num_beams=4 (BART-large-cnn's, Pegasus's) and pad_token_id=-1 (old Llama
    conversions): the command decodes greedily, on both paths, with num_beams=1 and the EOS id as pad (one prompt is
    never padded), and says so on stderr; it failed with generate's refusals, which told a command-line user to pass
    keywords the command does not have."""
    target, draft = pair
    folder = _with_generation_config(target, tmp_path / "beams", num_beams=4)
    saved = json.loads((folder / "generation_config.json").read_text())  # (save_pretrained refuses a -1 now)
    (folder / "generation_config.json").write_text(json.dumps({**saved, "pad_token_id": -1}))
    code = main(["generate", "--target", str(folder), "--draft", str(draft), "--prompt", "for i in",
                 "--max-new-tokens", "6", "--compare"])
    captured = capsys.readouterr()
    assert code == 0 and "outputs identical" in captured.out, (captured.out, captured.err)
    assert "num_beams=4 (beam search)" in captured.err and "pad_token_id=-1, not a token id" in captured.err


@pytest.mark.parametrize("drafting, option", [(["--prompt-lookup", "3", "--gamma", "7"], "--gamma"),
                                              (["--prompt-lookup", "3", "--gamma", "auto"], "--gamma"),
                                              (["--draft", "DRAFT", "--max-ngram", "4"], "--max-ngram"),
                                              (["--early-exit", "1", "--max-ngram", "4"], "--max-ngram")])
def test_an_option_of_the_other_drafting_mode_is_refused(pair, capsys, drafting, option):
    """--gamma with --prompt-lookup (K is the draft length there) and --max-ngram with --draft do nothing: refused by
    name, as --top-k with greedy decoding is (they were ignored, and --gamma auto printed "gamma auto -> K")."""
    target, draft = pair
    drafting = [str(draft) if a == "DRAFT" else a for a in drafting]
    code = main(["generate", "--target", str(target), "--prompt", "x", "--max-new-tokens", "3", *drafting])
    assert code == 2 and f"{option} only applies with" in capsys.readouterr().err


def test_requests_past_a_learned_position_table_are_usage_errors(tmp_path, capsys):
    """Where positions are a learned table (BART's encoder and decoder, GPT-2), a request past it fails with an
    IndexError inside the model, in model.generate too; the command checks the target's context length for
    encoder-decoder models as well, and the draft's, and says so in one error line (they were tracebacks, exit
    status 1, which --compare uses for "outputs differ")."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration, GPT2Config, GPT2LMHeadModel

    from helpers.checkpoints import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    special = dict(vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    bart = BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
                      decoder_start_token_id=2, **special)
    models = {"bart": BartForConditionalGeneration(bart),
              "gpt2": GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=64, **special)),
              "gpt2-short": GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8, **special))}
    for name, model in models.items():
        model.eval().save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    cases = [("bart", "bart", "def add(a, b): return a + b " * 3, "4", "--prompt: its "),
             ("bart", "bart", "x", "17", "--max-new-tokens 17: with the decoder's start token"),
             ("gpt2", "gpt2-short", "x", "12", "exceeds the draft's context length (8 positions)")]
    for target, draft, prompt, count, message in cases:
        code = main(["generate", "--target", str(tmp_path / target), "--draft", str(tmp_path / draft),
                     "--prompt", prompt, "--max-new-tokens", count])
        assert code == 2 and message in capsys.readouterr().err
    # At the table's end exactly (the last new token is never fed back), as model.generate runs it: no error
    for target, count in (("bart", "16"), ("gpt2-short", "8")):
        code = main(["generate", "--target", str(tmp_path / target), "--draft", str(tmp_path / target),
                     "--prompt", "x", "--max-new-tokens", count, "--compare"])
        assert code == 0, capsys.readouterr().err


def test_compare_times_each_path_after_a_warm_up(pair, capsys, monkeypatch):
    """Each timed call follows an untimed one of the same path (the speculative call was the process's first
    generate, paying lazy imports and the kernels' first launch; model.generate then ran warm)."""
    import transformers

    import speculative_kernels
    from speculative_kernels import timing

    calls = []
    ours, theirs, timed = speculative_kernels.generate, transformers.GenerationMixin.generate, timing.timed_generate

    def our_generate(*args, **kwargs):
        calls.append(("ours", kwargs["max_new_tokens"]))
        return ours(*args, **kwargs)

    def their_generate(self, *args, **kwargs):
        calls.append(("hf", kwargs.get("max_new_tokens")))
        return theirs(self, *args, **kwargs)

    def timed_generate(fn, device):
        calls.append(("timed", None))
        return timed(fn, device)

    monkeypatch.setattr(speculative_kernels, "generate", our_generate)
    monkeypatch.setattr(transformers.GenerationMixin, "generate", their_generate)
    monkeypatch.setattr(timing, "timed_generate", timed_generate)
    target, draft = pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--max-new-tokens",
                 "20", "--compare"]) == 0
    assert calls == [("ours", 16), ("timed", None), ("ours", 20), ("hf", 16), ("timed", None), ("hf", 20)]


def _lora_adapter_folder(root, base):
    """A LoRA adapter folder (adapter_config.json + adapter weights, no config.json, no tokenizer) on checkpoint
    folder ``base``, as peft saves it after training; random adapter weights, so the adapter changes the tokens."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base)  # (its name_or_path: the adapter's base)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                             task_type="CAUSAL_LM")
    peft.get_peft_model(model, config).save_pretrained(root / "adapter")
    return root / "adapter"


def test_a_peft_adapter_folder_loads_as_from_pretrained_loads_it(pair, tmp_path, capsys):
    """--target/--draft naming a PEFT adapter folder (adapter_config.json, no config.json): loaded as
    AutoModelForCausalLM.from_pretrained loads it, the base named in adapter_config.json with the adapter, and the
    base's tokenizer (the folder has none). It was "Unrecognized model ... model_type" (config.json read first)."""
    import torch
    import transformers

    target, _ = pair
    adapter = _lora_adapter_folder(tmp_path, target)
    assert not (adapter / "config.json").exists() and not (adapter / "tokenizer.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(adapter).eval()
    assert model._hf_peft_config_loaded
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    ids = tokenizer("def add(a, b):", return_tensors="pt")["input_ids"]
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    expected = model.generate(ids, **options)[0, ids.shape[1]:]
    base = transformers.AutoModelForCausalLM.from_pretrained(target).eval().generate(ids, **options)[0, ids.shape[1]:]
    assert not torch.equal(expected, base)  # (the adapter acts: loading the base alone would give other tokens)
    code = main(["generate", "--target", str(adapter), "--draft", str(adapter), "--prompt", "def add(a, b):",
                 "--max-new-tokens", "10", "--gamma", "3", "--compare"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = captured.out
    assert out.split("\nspeculative:")[0] == tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert "speculative: 10 tokens" in out and "acceptance rate 1.000" in out and "outputs identical" in out


def test_a_peft_adapter_folder_whose_base_is_missing_is_a_clear_error(pair, tmp_path, capsys):
    import json

    target, draft = pair
    adapter = _lora_adapter_folder(tmp_path, target)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "moved")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    for role, folders in (("target", (adapter, draft)), ("draft", (target, adapter))):
        code = main(["generate", "--target", str(folders[0]), "--draft", str(folders[1]), "--prompt", "x"])
        err = capsys.readouterr().err
        assert code == 2 and f"{adapter} is a PEFT adapter folder" in err, (role, err)
        assert f"base model '{tmp_path / 'moved'}'" in err and "cannot be found" in err, (role, err)


def test_a_checkpoint_saying_use_cache_false_runs(pair, tmp_path, capsys):
    """A checkpoint saved after training with gradient checkpointing says use_cache false (generation_config.json
    and config.json): the command passes use_cache=True to both paths, as the cache changes the speed, not the
    tokens. It exited 2 with generate's "pass use_cache=True", which a command-line user cannot."""
    import json

    target, draft = pair
    folder = _with_generation_config(target, tmp_path / "no-cache", use_cache=False)
    config = json.loads((folder / "config.json").read_text())
    config["use_cache"] = False
    (folder / "config.json").write_text(json.dumps(config))
    code = main(["generate", "--target", str(folder), "--draft", str(draft), "--prompt", "for i in",
                 "--max-new-tokens", "8", "--compare"])
    captured = capsys.readouterr()
    assert code == 0 and "outputs identical" in captured.out, captured.err


def test_a_padded_draft_vocabulary_without_a_draft_tokenizer_is_said_in_cli_terms(pair, tmp_path, capsys):
    """A draft folder with no tokenizer whose vocabulary is padded (128 ids against the target's 97): the error says
    what the folder lacks; it told a command-line user to "pass tokenizer= and assistant_tokenizer=" (Python
    arguments)."""
    from helpers.models import llama

    target, _ = pair
    llama(layers=1, vocab=128, seed=1).save_pretrained(tmp_path / "draft")
    code = main(["generate", "--target", str(target), "--draft", str(tmp_path / "draft"), "--prompt", "x",
                 "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--draft {tmp_path / 'draft'}: the folder has no tokenizer" in err
    assert "(logits 128 vs 97 wide, config vocab_size 128 vs 97)" in err and "tokenizer=" not in err


def test_a_checkpoints_max_new_tokens_is_the_default(pair, tmp_path, capsys):
    """model.generate takes a checkpoint's max_new_tokens; the CLI replaced it with its own 64 (--compare said
    "identical": both runs had 64). --max-new-tokens still overrides it; 64 where nothing sets it."""
    target, draft = pair
    folder = _with_generation_config(target, tmp_path / "seven", max_new_tokens=7)
    assert main(["generate", "--target", str(folder), "--draft", str(draft), "--prompt", "for i in",
                 "--compare"]) == 0
    out = capsys.readouterr().out
    assert "speculative: 7 tokens" in out and "model.generate: 7 tokens" in out, out
    assert main(["generate", "--target", str(folder), "--draft", str(draft), "--prompt", "for i in",
                 "--max-new-tokens", "5"]) == 0
    assert "speculative: 5 tokens" in capsys.readouterr().out


def test_a_negative_ngram_size_names_the_right_bound(pair, capsys):
    target, draft = pair
    with pytest.raises(SystemExit) as exit_info:  # (it said ">= 1", and 0 is accepted)
        main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x",
              "--no-repeat-ngram-size", "-1"])
    assert exit_info.value.code == 2
    assert "--no-repeat-ngram-size: must be >= 0, got -1" in capsys.readouterr().err


def test_a_checkpoints_max_new_tokens_past_the_context_is_named_as_the_checkpoints(pair, tmp_path, capsys):
    target, draft = pair
    folder = _with_generation_config(target, tmp_path / "long", max_new_tokens=100000)
    assert main(["generate", "--target", str(folder), "--draft", str(draft), "--prompt", "for i in"]) == 2
    assert "max_new_tokens (from the target's generation_config; --max-new-tokens sets another) 100000" in \
        capsys.readouterr().err


def _parse(*argv):
    parser = argparse.ArgumentParser()
    cli_options.add_common_options(parser)
    return parser.parse_args(list(argv))


def test_greedy_runs_keep_the_logits_processor_options():
    kwargs = cli_options.sampling_kwargs(_parse("--repetition-penalty", "1.3", "--no-repeat-ngram-size", "2"))
    assert kwargs == dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2)


def test_prefill_chunk_size_option(pair, capsys):
    """--prefill-chunk-size is HF's prefill_chunk_size on both paths (greedy: identical); 0 is a usage error."""
    assert cli_options.sampling_kwargs(_parse("--prefill-chunk-size", "3")) == dict(do_sample=False,
                                                                                    prefill_chunk_size=3)
    target, draft = pair
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def add(a, b):",
                 "--max-new-tokens", "12", "--gamma", "3", "--prefill-chunk-size", "2", "--compare"])
    assert code == 0 and "outputs identical" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _parse("--prefill-chunk-size", "0")


def test_min_p_above_one_is_a_usage_error():
    with pytest.raises(cli_options.UsageError, match="--min-p must be in"):
        cli_options.check_sampling_options(_parse("--temperature", "1", "--min-p", "1.5"))


def test_a_paused_auto_gamma_is_said_in_words():
    """'auto' ending paused printed "gamma auto -> 0", which reads as a broken setting."""
    assert cli_options.auto_gamma_text(0).startswith("0 (paused: the target decodes alone")
    assert cli_options.auto_gamma_text(6) == "6"


def test_a_draft_with_another_tokenizer_drafts_through_the_text(tmp_path, capsys):
    """A draft folder whose tokenizer has another vocabulary than the target's (the command passes both tokenizers):
    universal assisted generation, greedy output identical to model.generate (it was refused as "different
    vocabularies")."""
    from helpers.models import llama
    from helpers.tiny_tokenizers import byte_bpe

    for name, tokenizer, model in (("target", byte_bpe(300), llama(vocab=300)),
                                   ("draft", byte_bpe(259), llama(layers=1, vocab=259, seed=4))):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    code = main(["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt",
                 "the cat sat", "--max-new-tokens", "8", "--gamma", "3", "--compare"])
    captured = capsys.readouterr()
    assert code == 0 and "outputs identical" in captured.out, captured.err


def test_compare_names_model_generate_when_it_is_what_fails(pair, capsys, monkeypatch):
    """--compare where plain model.generate itself fails with the options (Mamba2 with --prefill-chunk-size: HF's
    ValueError from its cache) after ours ran: one error line that says model.generate failed and why, status 2, not
    HF's message alone as if it were ours (nor a traceback with status 3 for an error of another type)."""
    import transformers

    target, draft = pair

    def failing(self, *args, **kwargs):
        raise RuntimeError("the cache cannot do that")

    monkeypatch.setattr(transformers.GenerationMixin, "generate", failing)
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def add(a, b):",
                 "--max-new-tokens", "6", "--gamma", "3", "--compare"])
    captured = capsys.readouterr()
    assert code == 2 and "speculative:" in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        f"error: --compare: model.generate (transformers {transformers.__version__}) fails with these options where "
        "speculative_kernels ran (its completion is above), so there is nothing to compare: RuntimeError: the cache "
        "cannot do that")
