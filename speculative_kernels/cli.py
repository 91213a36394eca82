"""The ``speculative-kernels`` command: ``generate`` (a user's model pair) and ``demo`` (the bundled pair).

Nothing heavy is imported before the arguments are parsed (``--help`` is instant); torch and transformers come in
when a command runs. A user's mistake (a bad option value, a device or backend this machine lacks, a model folder
that is not there, a request that cannot fit) ends with one ``error:`` line on stderr and exit status 2, as
argparse's own errors do.
"""

import argparse
import statistics
import sys
import time

DESCRIPTION = "Exact speculative decoding for Hugging Face models (Leviathan et al. 2023)."
ACCEPTANCE_LEGEND = ("acceptance rate = accepted drafts / drafted tokens (the drafts after a rejection count as "
                     "drafted, never tested); alpha = the paper's per-token acceptance probability (accept tests "
                     "passed / tests made)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default in its help (unless it is None or a False flag, whose
    help says what happens)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class UsageError(ValueError):
    """A mistake in the command line that argparse cannot see (it depends on the machine or the models)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def gamma_arg(text: str):
    """--gamma: a positive int, or "auto" (calibrated per run, ``generation/gamma.py``)."""
    return "auto" if text == "auto" else _positive_int(text)


def _sampling_kwargs(args) -> dict:
    if args.temperature == 0.0:
        return dict(do_sample=False)
    return dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def check_sampling_options(args) -> None:
    """Greedy decoding (temperature 0) has no use for top-k/top-p: refuse them rather than drop them. Sampling
    values are checked before any model is loaded."""
    from .ops.validation import check_sampling_params

    if args.temperature == 0.0 and (args.top_k != 0 or args.top_p != 1.0):
        raise UsageError("--top-k/--top-p only apply when sampling (--temperature > 0); greedy decoding "
                         "(--temperature 0, the default) would ignore them")
    check_sampling_params(args.temperature, args.top_k, args.top_p)


def resolve_device(args) -> None:
    """args.device 'auto' -> 'cuda' or 'cpu'; a device this machine lacks, or a --backend that cannot run on it, is a
    UsageError."""
    import torch

    from .ops import backends

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a device name (use cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: speculative_kernels runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available here (torch {torch.__version__}); "
                             "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    try:
        backends.resolve(args.backend, device.type)
    except RuntimeError as exc:
        raise UsageError(f"--backend {args.backend}: {exc}") from None


def _sync(device) -> None:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(fn, device):
    """(result, seconds) of fn() with the device (a str or torch.device) synchronised around it."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def timed_median(fn, device, repeats: int):
    """(last result, median seconds over ``repeats`` timed calls) of fn(), after one untimed warm-up call."""
    fn()
    times, result = [], None
    for _ in range(repeats):
        result, seconds = timed_generate(fn, device)
        times.append(seconds)
    return result, statistics.median(times)


def add_common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=_non_negative_float, default=0.0,
                        help="sampling temperature; 0 = greedy decoding")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens when sampling (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling (1 = off)")
    parser.add_argument("--gamma", type=gamma_arg, default=5,
                        help="draft tokens per iteration, or 'auto' (chosen from the measured acceptance and costs)")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before each run")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, float16 or bfloat16")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton", "cuda"],
                        help="verification kernels (auto: cuda, then triton on a GPU; torch elsewhere)")


def prepare_run(args) -> None:
    """The checks every command makes once its arguments are parsed (see ``UsageError``)."""
    check_sampling_options(args)
    resolve_device(args)


def _encode(tokenizer, model, prompt: str, device: str):
    """(input_ids [1, L], attention_mask [1, L]) of a prompt. An empty prompt starts from the BOS token (explicitly,
    so both generate paths see the same one-token prompt and the new tokens are counted after it)."""
    import torch

    if tokenizer is None:
        raise UsageError("the target folder has no tokenizer; a text prompt needs one")
    encoded = tokenizer(prompt, return_tensors="pt")
    input_ids, attention_mask = encoded["input_ids"], encoded["attention_mask"]
    if input_ids.shape[1] == 0:
        bos = tokenizer.bos_token_id
        if bos is None:
            bos = model.generation_config.bos_token_id
        if bos is None:
            raise UsageError("--prompt is empty and neither the tokenizer nor the model has a BOS token to start from")
        input_ids = torch.tensor([[int(bos)]])
        attention_mask = torch.ones_like(input_ids)
    return input_ids.to(device), attention_mask.to(device)


def check_length(model, input_ids, max_new_tokens: int) -> None:
    """--max-new-tokens beyond the target's context length (decoder-only models that state one) is a UsageError."""
    if model.config.is_encoder_decoder:
        return
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and input_ids.shape[1] + max_new_tokens > positions:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: with the {input_ids.shape[1]}-token prompt that exceeds "
                         f"the target's context length ({positions} positions)")


def run_generate(args) -> int:
    import torch

    from . import generate
    from .generation.stats import SpeculationStats
    from .model_loading import load_model

    from transformers.utils import logging as hf_logging

    prepare_run(args)
    hf_logging.disable_progress_bar()  # "Loading weights" bars on stderr would bury an error line
    target, tokenizer = load_model(args.target, device=args.device, dtype=args.dtype,
                                   trust_remote_code=args.trust_remote_code)
    draft, draft_tokenizer = load_model(args.draft, device=args.device, dtype=args.dtype,
                                        trust_remote_code=args.trust_remote_code)
    input_ids, attention_mask = _encode(tokenizer, target, args.prompt, args.device)
    check_length(target, input_ids, args.max_new_tokens)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=args.max_new_tokens, **_sampling_kwargs(args))
    stats = SpeculationStats()
    torch.manual_seed(args.seed)
    output, seconds = timed_generate(
        lambda: generate(target, input_ids, draft_model=draft, num_speculative_tokens=args.gamma,
                         tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer, speculation_stats=stats,
                         backend=args.backend, **kwargs),
        args.device,
    )
    new_tokens = _new_tokens(target, input_ids, output)
    print(tokenizer.decode(new_tokens, skip_special_tokens=True))
    print(f"\nspeculative: {len(new_tokens)} tokens in {seconds:.3f} s = {len(new_tokens) / seconds:.1f} tokens/s; "
          f"acceptance rate {stats.acceptance_rate:.3f}, alpha {stats.alpha:.3f}, "
          f"{stats.mean_tokens_per_target_forward:.2f} tokens per target forward"
          + (f"; gamma auto -> {stats.num_speculative_tokens}" if args.gamma == "auto" else ""))
    print(f"({ACCEPTANCE_LEGEND})")
    if not args.compare:
        return 0
    torch.manual_seed(args.seed)
    baseline, base_seconds = timed_generate(lambda: target.generate(input_ids, **kwargs), args.device)
    base_tokens = _new_tokens(target, input_ids, baseline)
    identical = base_tokens == new_tokens
    print(f"model.generate: {len(base_tokens)} tokens in {base_seconds:.3f} s = "
          f"{len(base_tokens) / base_seconds:.1f} tokens/s")
    print(f"speedup {base_seconds / seconds * len(new_tokens) / max(len(base_tokens), 1):.2f}x; outputs "
          + ("identical" if identical else "differ" + (" (expected when sampling)" if args.temperature else "")))
    return 0 if identical or args.temperature > 0 else 1


def _new_tokens(model, input_ids, output) -> list[int]:
    """The generated ids of row 0 (decoder-only outputs repeat the prompt; encoder-decoder outputs do not)."""
    if model.config.is_encoder_decoder:
        return output[0, 1:].tolist()
    return output[0, input_ids.shape[1]:].tolist()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculative-kernels", description=DESCRIPTION,
                                     formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate", help="speculative decoding with your own target/draft checkpoints", formatter_class=HelpFormatter,
        description="Complete a prompt with your own target and draft checkpoints (local Hugging Face folders), "
                    "print the completion, tokens/s and the acceptance rate; --compare also runs plain "
                    "model.generate and exits with status 1 if greedy outputs differ.")
    gen.add_argument("--target", required=True, help="local HF model folder of the target")
    gen.add_argument("--draft", required=True, help="local HF model folder of the draft")
    gen.add_argument("--prompt", required=True, help="the text to complete (empty: start from the BOS token)")
    gen.add_argument("--compare", action="store_true", help="also run plain model.generate and compare")
    gen.add_argument("--trust-remote-code", action="store_true", help="allow the folders' own model code")
    add_common_options(gen)
    gen.set_defaults(run=run_generate)
    from .demo import add_demo_command

    add_demo_command(commands)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
