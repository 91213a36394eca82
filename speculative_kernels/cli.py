"""The ``speculative-kernels`` command: ``generate`` (a user's model pair) and ``demo`` (the bundled pair)."""

import argparse
import sys
import statistics
import time

import torch


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def gamma_arg(text: str):
    """--gamma: a positive int, or "auto" (calibrated per run, ``generation/gamma.py``)."""
    return "auto" if text == "auto" else _positive_int(text)


def _sampling_kwargs(args) -> dict:
    if args.temperature == 0.0:
        return dict(do_sample=False)
    return dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _sync(device) -> None:
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
    parser.add_argument("--max-new-tokens", type=_positive_int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--gamma", type=gamma_arg, default=5,
                        help="draft tokens per iteration, or 'auto' (chosen from the measured acceptance and costs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton", "cuda"])


def _encode(tokenizer, model, prompt: str, device: str):
    if tokenizer is None:
        raise ValueError("the target folder has no tokenizer; a text prompt needs one")
    encoded = tokenizer(prompt, return_tensors="pt")
    return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)


def run_generate(args) -> int:
    from . import generate
    from .generation.stats import SpeculationStats
    from .model_loading import load_model

    target, tokenizer = load_model(args.target, device=args.device, dtype=args.dtype,
                                   trust_remote_code=args.trust_remote_code)
    draft, draft_tokenizer = load_model(args.draft, device=args.device, dtype=args.dtype,
                                        trust_remote_code=args.trust_remote_code)
    input_ids, attention_mask = _encode(tokenizer, target, args.prompt, args.device)
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
          f"acceptance rate {stats.acceptance_rate:.3f}, {stats.mean_tokens_per_target_forward:.2f} tokens per "
          "target forward" + (f"; gamma auto -> {stats.num_speculative_tokens}" if args.gamma == "auto" else ""))
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
    parser = argparse.ArgumentParser(prog="speculative-kernels", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="speculative decoding with your own target/draft checkpoints")
    gen.add_argument("--target", required=True, help="local HF model folder of the target")
    gen.add_argument("--draft", required=True, help="local HF model folder of the draft")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--compare", action="store_true", help="also run plain model.generate and compare")
    gen.add_argument("--trust-remote-code", action="store_true")
    add_common_options(gen)
    gen.set_defaults(run=run_generate)
    try:
        from .demo import add_demo_command
    except ImportError:
        add_demo_command = None
    if add_demo_command is not None:
        add_demo_command(commands)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
