"""The ``speculative-kernels`` command: ``generate`` (a user's model pair) and ``demo`` (the bundled pair).

Nothing heavy is imported before the arguments are parsed (``--help`` is instant); torch and transformers come in
when a command runs. A user's mistake (a bad option value, a device or backend this machine lacks, a model folder
that is not there, a request that cannot fit) ends with one ``error:`` line on stderr and exit status 2, as
argparse's own errors do. Any other failure prints its traceback and exits with status 3, never 1 (``--compare`` and
the demo's "outputs differ").
"""

import argparse
import sys
import traceback

from .cli_options import (
    ACCEPTANCE_LEGEND,
    DEFAULT_MAX_NEW_TOKENS,
    HelpFormatter,
    UsageError,
    add_common_options,
    auto_gamma_text,
    check_one_completion,
    checkpoint_overrides,
    completion_ids,
    encode_prompt,
    prepare_run,
    sampling_kwargs,
)
from .demo import add_demo_command

DEFAULT_MAX_NGRAM = 2
WARM_UP_TOKENS = 16  # new tokens of the untimed call that precedes each timed path
DESCRIPTION = "Exact speculative decoding for Hugging Face models (Leviathan et al. 2023)."


def check_length(model, input_ids, max_new_tokens: int, role: str = "target",
                 source: str = "--max-new-tokens") -> None:
    """A UsageError where the request passes the context length (``max_position_embeddings``) that ``model`` (the
    ``role``: target or draft) states: a decoder-only model's [1, L] prompt plus max_new_tokens less one (the last
    new token is never fed back); an encoder-decoder model's encoder input ``input_ids`` [1, L], or its decoder's
    start token plus max_new_tokens less one (BART's learned positions fail beyond it with an IndexError, in
    model.generate too)."""
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if positions is None:
        return
    limit = f"the {role}'s context length ({positions} positions)"
    if not model.config.is_encoder_decoder:
        if input_ids.shape[1] + max_new_tokens - 1 > positions:
            raise UsageError(f"{source} {max_new_tokens}: with the {input_ids.shape[1]}-token prompt that "
                             f"exceeds {limit}")
    elif input_ids.shape[1] > positions:
        raise UsageError(f"--prompt: its {input_ids.shape[1]} tokens exceed {limit}")
    elif max_new_tokens > positions:
        raise UsageError(f"{source} {max_new_tokens}: with the decoder's start token that exceeds {limit}")


def check_draft_vocabulary(target, draft, folder) -> None:
    """A UsageError where the draft folder has no tokenizer and the draft's vocabulary differs in size from the
    target's (logit widths or config vocab_size: a padded vocabulary). generate accepts such a pair only once both
    tokenizers show that they give every token the same id, and this command has no draft tokenizer to pass."""
    from .generation.vocab import logit_width

    widths = logit_width(draft), logit_width(target)
    sizes = draft.config.get_text_config().vocab_size, target.config.get_text_config().vocab_size
    if widths[0] != widths[1] or sizes[0] != sizes[1]:
        raise UsageError(f"--draft {folder}: the folder has no tokenizer, and the draft's vocabulary differs in size "
                         f"from the target's (logits {widths[0]} vs {widths[1]} wide, config vocab_size {sizes[0]} vs "
                         f"{sizes[1]}), so its ids cannot be checked against the target's tokenizer; save the "
                         "tokenizer the draft was trained with into the draft folder")


def run_generate(args) -> int:
    import torch

    from . import SpeculationStats, generate
    from .model_loading import load_model
    from .timing import timed_generate

    from transformers.utils import logging as hf_logging

    prepare_run(args)
    drafting = _drafting(args)
    hf_logging.disable_progress_bar()  # "Loading weights" bars on stderr would bury an error line
    target, tokenizer = load_model(args.target, device=args.device, dtype=args.dtype,
                                   trust_remote_code=args.trust_remote_code)
    if args.draft is not None:
        draft, draft_tokenizer = load_model(args.draft, device=args.device, dtype=args.dtype,
                                            trust_remote_code=args.trust_remote_code)
        drafting = dict(draft_model=draft, num_speculative_tokens=args.gamma, assistant_tokenizer=draft_tokenizer)
    check_one_completion(target)
    source = "--max-new-tokens"
    if args.max_new_tokens is None:  # the checkpoint's, as model.generate reads it (its max_length is not a count)
        args.max_new_tokens = target.generation_config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        if target.generation_config.max_new_tokens:
            source = "max_new_tokens (from the target's generation_config; --max-new-tokens sets another)"
    input_ids, attention_mask = encode_prompt(tokenizer, target, args.prompt, args.device)
    check_length(target, input_ids, args.max_new_tokens, source=source)
    if args.draft is not None:
        check_length(draft, input_ids, args.max_new_tokens, role="draft", source=source)
        if draft_tokenizer is None:
            check_draft_vocabulary(target, draft, args.draft)
    # tokenizer= on both sides: a checkpoint's stop_strings need it (model.generate fails without it). use_cache=True
    # on both: a checkpoint saved after training with gradient checkpointing often says use_cache false, which
    # generate refuses (it rolls back the KV cache); the cache changes the speed, not the tokens
    overrides, notes = checkpoint_overrides(target)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=args.max_new_tokens, tokenizer=tokenizer,
                  use_cache=True, **sampling_kwargs(args), **overrides)
    # One short untimed call of each path before it is timed (lazy imports, backend resolution, the first launch
    # of the verification kernels: a Triton compile or the CUDA extension's build), as the demo does.
    warm_up = {**kwargs, "max_new_tokens": min(args.max_new_tokens, WARM_UP_TOKENS)}
    generate(target, input_ids, backend=args.backend, seed=args.seed, **drafting, **warm_up)
    stats = SpeculationStats()
    output, seconds = timed_generate(
        lambda: generate(target, input_ids, speculation_stats=stats, backend=args.backend, seed=args.seed,
                         **drafting, **kwargs),
        args.device,
    )
    new_tokens = completion_ids(target, input_ids, output)
    print(tokenizer.decode(new_tokens, skip_special_tokens=True))
    print(f"\nspeculative: {len(new_tokens)} tokens in {seconds:.3f} s = {len(new_tokens) / seconds:.1f} tokens/s; "
          + speculation_figures(stats, args.gamma == "auto"))
    if stats.drafted_tokens:
        print(f"({ACCEPTANCE_LEGEND})")
    if not args.compare:
        return 0
    try:
        target.generate(input_ids, **warm_up)
        torch.manual_seed(args.seed)  # model.generate has no seed argument
        baseline, base_seconds = timed_generate(lambda: target.generate(input_ids, **kwargs), args.device)
    except Exception as exc:  # noqa: BLE001 -- HF's own failure: named as such, not as ours (nor as a difference)
        if type(exc).__name__ == "OutOfMemoryError":
            raise
        import transformers

        raise ValueError(
            f"--compare: model.generate (transformers {transformers.__version__}) fails with these options where "
            f"speculative_kernels ran (its completion is above), so there is nothing to compare: "
            f"{type(exc).__name__}: {exc}") from exc
    base_tokens = completion_ids(target, input_ids, baseline)
    identical = base_tokens == new_tokens
    lookup = " (HF prompt lookup: the checkpoint's prompt_lookup_num_tokens)" if getattr(
        target.generation_config, "prompt_lookup_num_tokens", None) else ""
    print(f"model.generate{lookup}: {len(base_tokens)} tokens in {base_seconds:.3f} s = "
          f"{len(base_tokens) / base_seconds:.1f} tokens/s")
    print(f"speedup {base_seconds / seconds * len(new_tokens) / max(len(base_tokens), 1):.2f}x; outputs "
          + ("identical" if identical else "differ" + (" (expected when sampling)" if args.temperature else "")))
    if not identical and not args.temperature:
        step = next((i for i, (a, b) in enumerate(zip(new_tokens, base_tokens)) if a != b),
                    min(len(new_tokens), len(base_tokens)))
        at_step = (new_tokens[step] if step < len(new_tokens) else None,
                   base_tokens[step] if step < len(base_tokens) else None)
        print(describe_difference(
            step, lambda **extra: generate(target, input_ids, backend=args.backend, seed=args.seed, **drafting,
                                           **{**kwargs, **extra}),
            lambda **extra: target.generate(input_ids, **{**kwargs, **extra}), target.dtype, at_step))
    return 0 if identical or args.temperature > 0 else 1


def speculation_figures(stats, gamma_auto: bool) -> str:
    """The run's acceptance figures, in words where they are undefined (a zero would read as "every draft
    rejected"): nothing drafted (every token from a target forward alone: the prompt's, with max_new_tokens 1, or
    prompt lookup finding no match). Tokens per target forward: the new tokens over the target's forwards that gave
    them, every one counted (also those that drafted fewer than gamma or nothing;
    ``SpeculationStats.mean_tokens_per_target_forward``)."""
    if not stats.drafted_tokens:
        return ("nothing drafted: every token came from a target forward alone "
                "(max_new_tokens 1, or no proposal)")
    return (f"acceptance rate {stats.acceptance_rate:.3f}, alpha {stats.alpha:.3f}, "
            f"{stats.mean_tokens_per_target_forward:.2f} tokens per target forward"
            + (f"; gamma auto -> {auto_gamma_text(stats.num_speculative_tokens)}" if gamma_auto else ""))


def describe_difference(step: int, ours, reference, dtype, tokens: tuple[int, int] | None = None) -> str:
    """Where two greedy outputs of one prompt part (new token ``step``), and what the target's logits there say.

    ours / reference: ``fn(**generate_kwargs)`` re-running ``speculative_kernels.generate`` / ``model.generate`` on
    the prompt; both are run again as they ran (same lengths: a shorter run drafts fewer tokens near its end, so its
    verification forwards, and in half precision their rounding, would differ) with ``output_logits=True``.
    tokens: (ours, model.generate's) token at ``step`` in the runs being explained; a re-run that does not reproduce
    them is said so. Reports each side's preference for its own token and how far apart the two computations of
    that position's logits are, in units of ``dtype``'s (the model's) rounding at the logits' scale: a few units is
    the model's own rounding deciding a near-tie (a multi-token verification forward rounds differently from a
    one-token step in half precision: docs/half_precision.md); far more is a defect."""
    import torch

    extra = dict(output_logits=True, return_dict_in_generate=True)
    got, expected = ours(**extra), reference(**extra)
    if len(got.logits) <= step or len(expected.logits) <= step:
        return f"the outputs differ in length from new token {step} (one side stopped there)"
    mine, theirs = got.logits[step][0], expected.logits[step][0]
    # the tokens each run emitted there (its new tokens are the last len(logits) of its sequence)
    token, their_token = (int(run.sequences[0, run.sequences.shape[1] - len(run.logits) + step])
                          for run in (got, expected))
    if tokens is not None and (token, their_token) != tuple(tokens):
        return (f"first difference at new token {step}: ours {tokens[0]}, model.generate {tokens[1]}; re-run with "
                f"output_logits to explain it, they emitted {token} and {their_token} there instead, so this "
                "difference does not reproduce (a nondeterministic kernel?); compare the runs' logits yourself "
                "(generate(..., output_logits=True, return_dict_in_generate=True))")
    mine64, theirs64 = mine.double(), theirs.double()
    spread = (mine64 - theirs64).abs().max().item()
    scale = theirs64.abs().max().item()
    roundoff = torch.finfo(dtype).eps / 2 * scale
    margin = (theirs64[their_token] - theirs64[token]).item()
    tie = " (an exact tie: argmax takes the lower id)" if margin == 0 else ""
    return (f"first difference at new token {step}: ours {token}, model.generate {their_token}. There "
            f"model.generate's logits prefer its token by {margin:.4g}{tie}, "
            f"ours prefer ours by {(mine64[token] - mine64[their_token]).item():.4g}; the two computations of those "
            f"logits differ by up to {spread:.4g} = {spread / roundoff:.1f} x {dtype}'s rounding at the "
            f"logits' scale ({scale:.4g}). A few roundings: a near-tie the model's own rounding decides (a "
            "multi-token forward rounds differently from a one-token step; docs/half_precision.md). Far more: "
            "a defect, please report it.")


def _drafting(args) -> dict:
    """generate's drafting arguments without a draft model (--prompt-lookup, --early-exit); a UsageError unless
    exactly one of --draft, --prompt-lookup and --early-exit is given, or when an option of another one is (it would
    do nothing: --gamma with --prompt-lookup, whose K is the draft length, --max-ngram without --prompt-lookup).
    Fills in their defaults."""
    given = [name for name, value in (("--draft", args.draft), ("--prompt-lookup", args.prompt_lookup),
                                      ("--early-exit", args.early_exit)) if value is not None]
    if len(given) != 1:
        raise UsageError("pass exactly one of --draft (a draft model), --prompt-lookup K (no draft model) and "
                         "--early-exit N (the target's first N layers draft)"
                         + (f"; got {' and '.join(given)}" if given else ""))
    if args.prompt_lookup is None:
        if args.max_ngram is not None:
            raise UsageError(f"--max-ngram only applies with --prompt-lookup; with {given[0]} it would be ignored")
        # (--gamma unset: None, so that generate takes a checkpoint's num_assistant_tokens, else its default 5)
        if args.early_exit is not None:
            return dict(assistant_early_exit=args.early_exit, num_speculative_tokens=args.gamma)
        return {}
    if args.gamma is not None:
        raise UsageError("--gamma only applies with --draft or --early-exit; with --prompt-lookup K, K is the number "
                         "of tokens drafted per iteration")
    max_ngram = DEFAULT_MAX_NGRAM if args.max_ngram is None else args.max_ngram
    return dict(prompt_lookup_num_tokens=args.prompt_lookup, max_matching_ngram_size=max_ngram)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculative-kernels", description=DESCRIPTION,
                                     formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate", help="speculative decoding with your own target/draft checkpoints", formatter_class=HelpFormatter,
        description="Complete a prompt with your own target and draft checkpoints (local Hugging Face folders), "
                    "print the completion, tokens/s and the acceptance rate; --compare also runs plain "
                    "model.generate and exits with status 1 if greedy outputs differ. Each path is timed over one "
                    f"call, after an untimed call of at most {WARM_UP_TOKENS} new tokens (warm-up).")
    gen.add_argument("--target", required=True,
                     help="local HF model folder of the target (or a PEFT adapter folder: loaded as from_pretrained "
                          "loads it, onto the base its adapter_config.json names)")
    gen.add_argument("--draft", help="local HF model folder of the draft, or a PEFT adapter folder (or "
                                     "--prompt-lookup, or --early-exit)")
    gen.add_argument("--prompt-lookup", type=_positive, metavar="K",
                     help="no draft model: draft up to K tokens per iteration by prompt lookup (HF's "
                          "prompt_lookup_num_tokens; K replaces --gamma)")
    gen.add_argument("--early-exit", type=_positive, metavar="N",
                     help="no draft model: the target's first N decoder layers, its final norm and LM head draft "
                          "(HF's assistant_early_exit; LayerSkip checkpoints are trained for it)")
    gen.add_argument("--max-ngram", type=_positive, metavar="N",
                     help="with --prompt-lookup: the longest n-gram matched (HF's max_matching_ngram_size; default "
                          f"{DEFAULT_MAX_NGRAM})")
    gen.add_argument("--prompt", required=True, help="the text to complete (empty: start from the BOS token)")
    gen.add_argument("--compare", action="store_true", help="also run plain model.generate and compare")
    gen.add_argument("--trust-remote-code", action="store_true", help="allow the folders' own model code")
    add_common_options(gen, gamma_default=None)  # None: not given (generate's own gamma; see _drafting)
    gen.set_defaults(run=run_generate)
    add_demo_command(commands)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 -- not a usage error, nor a difference (status 1): a status of its own
        if type(exc).__name__ == "OutOfMemoryError":  # torch's (a RuntimeError): the request does not fit the device
            print(f"error: out of device memory: {exc}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"error: unexpected {type(exc).__name__} (the traceback above; please report it)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
