"""What the ``speculative-kernels`` commands share: option types, the common options, and the checks every command
makes once its arguments are parsed. Imports neither torch nor transformers at module level (``--help`` stays
instant)."""

import argparse

ACCEPTANCE_LEGEND = ("acceptance rate = accepted drafts / drafted tokens (the drafts after a rejection count as "
                     "drafted, never tested); alpha = the paper's per-token acceptance probability (accept tests "
                     "passed / tests made)")


DEFAULT_GAMMA = 5


def auto_gamma_text(gamma: int) -> str:
    """num_speculative_tokens="auto"'s last choice, in words where it is a pause (0: the target decoding alone)."""
    return "0 (paused: the target decodes alone, probing now and then)" if gamma == 0 else str(gamma)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default in its help (unless it is None or a False flag, whose
    help says what happens)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class UsageError(ValueError):
    """A mistake in the command line that argparse cannot see (it depends on the machine or the models)."""


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError("must be > 0, got 0")
    return value


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def seed_arg(text: str) -> int:
    """--seed: an int in [0, 2**63), the range of ``generate(seed=...)``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {value}")
    return value


def gamma_arg(text: str):
    """--gamma: a positive int, or "auto" (calibrated per run, ``generation/gamma.py``)."""
    return "auto" if text == "auto" else positive_int(text)


def sampling_kwargs(args) -> dict:
    """generate's keywords for the sampling, logits-processor and --prefill-chunk-size options (an option left
    unset: the checkpoint's generation_config decides, as in model.generate; e.g. top_k 50 where it says nothing,
    HF's default)."""
    processors = {name: getattr(args, name) for name in ("repetition_penalty", "no_repeat_ngram_size", "min_p",
                                                           "prefill_chunk_size")
                  if getattr(args, name, None) is not None}
    if args.temperature == 0.0:
        return dict(do_sample=False, **processors)
    warpers = {name: getattr(args, name) for name in ("top_k", "top_p") if getattr(args, name) is not None}
    return dict(do_sample=True, temperature=args.temperature, **warpers, **processors)


def check_sampling_options(args) -> None:
    """Greedy decoding (temperature 0) has no use for top-k/top-p: refuse them rather than drop them. Sampling
    values are checked before any model is loaded."""
    from .ops.validation import check_sampling_params

    if args.temperature == 0.0 and (args.top_k is not None or args.top_p is not None or args.min_p is not None):
        raise UsageError("--top-k/--top-p/--min-p only apply when sampling (--temperature > 0); greedy decoding "
                         "(--temperature 0, the default) would ignore them")
    if args.min_p is not None and not 0.0 <= args.min_p <= 1.0:
        raise UsageError(f"--min-p must be in [0, 1], got {args.min_p}")
    check_sampling_params(args.temperature, args.top_k or 0, 1.0 if args.top_p is None else args.top_p)


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


def encode_prompt(tokenizer, model, prompt: str, device: str):
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
        input_ids = torch.tensor([[int(bos)]], device="cpu")
        attention_mask = torch.ones_like(input_ids)
    return input_ids.to(device), attention_mask.to(device)


def completion_ids(model, input_ids, output) -> list[int]:
    """The generated ids of row 0 of a generate output: a tensor (decoder-only [B, L + new], repeating the [B, L]
    prompt ``input_ids``; encoder-decoder [B, 1 + new], from the decoder start token) or a dict output holding one as
    ``sequences`` (a checkpoint whose generation_config sets return_dict_in_generate)."""
    sequences = getattr(output, "sequences", output)
    start = 1 if model.config.is_encoder_decoder else input_ids.shape[1]
    return sequences[0, start:].tolist()


def check_one_completion(model) -> None:
    """The commands print one completion of one prompt: a target whose generation_config asks for several
    (num_return_sequences > 1) is a UsageError, rather than rows generated, timed and not shown."""
    count = getattr(model.generation_config, "num_return_sequences", None)
    if count is not None and count != 1:
        raise UsageError(f"the target's generation_config sets num_return_sequences={count}; this command prints "
                         "one completion (set it to 1 in the checkpoint's generation_config.json)")


def checkpoint_overrides(model) -> tuple[dict, list[str]]:
    """generate's keywords (for both paths: ours and ``--compare``'s model.generate) that replace what the target's
    generation_config sets and this command cannot run, with a note for each, printed: a ``num_beams`` > 1
    (BART-large-cnn's, Pegasus's, Marian's: beam search, which model.generate would run) becomes 1, since this command
    decodes greedily or samples (``--temperature``); a ``pad_token_id`` that is not a token id (old conversions'
    -1) becomes the first EOS id, as model.generate pads without one (one prompt is never padded, so the tokens
    are the same)."""
    from .generation.settings import token_ids

    config, overrides, notes = model.generation_config, {}, []
    beams = getattr(config, "num_beams", None)
    if beams is not None and beams != 1:
        overrides["num_beams"] = 1
        notes.append(f"the target's generation_config sets num_beams={beams} (beam search); this command decodes "
                     "greedily or samples (--temperature): num_beams=1")
    try:
        token_ids("pad_token_id", config.pad_token_id)
    except (TypeError, ValueError):
        eos = token_ids("eos_token_id", config.eos_token_id)
        if eos:
            overrides["pad_token_id"] = eos[0]
            notes.append(f"the target's generation_config sets pad_token_id={config.pad_token_id!r}, not a token id; "
                         f"one prompt is never padded: pad_token_id={eos[0]} (its EOS id)")
    return overrides, notes


DEFAULT_MAX_NEW_TOKENS = 64  # where neither --max-new-tokens nor the checkpoint's generation_config says


def add_common_options(parser: argparse.ArgumentParser, gamma_default=DEFAULT_GAMMA,
                       max_new_tokens_default: int | None = None, dtype_auto: str = "the checkpoint's") -> None:
    """The options both commands take. gamma_default None: --gamma left unset reads None (``generate`` then tells
    it from a --gamma given where it does nothing). dtype_auto: what --dtype auto loads, for its help."""
    parser.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens_default,
                        help="tokens to generate at most" + ("" if max_new_tokens_default is not None else
                                                             " (default: the target checkpoint's generation_config "
                                                             f"max_new_tokens, else {DEFAULT_MAX_NEW_TOKENS})"))
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="sampling temperature; 0 = greedy decoding")
    parser.add_argument("--top-k", type=int, default=None,
                        help="keep the k most likely tokens when sampling (0 = off; default: the checkpoint's "
                             "generation_config, 50 where it says nothing, as in model.generate)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling mass when sampling (1 = off; default: the checkpoint's)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="drop tokens below min_p times the top probability when sampling (HF's min_p; "
                             "default: the checkpoint's)")
    parser.add_argument("--repetition-penalty", type=positive_float, default=None,
                        help="HF's repetition_penalty (e.g. 1.1; default: the checkpoint's generation_config)")
    parser.add_argument("--no-repeat-ngram-size", type=non_negative_int, default=None,
                        help="never repeat an n-gram of this size (HF's no_repeat_ngram_size; default: the "
                             "checkpoint's)")
    parser.add_argument("--prefill-chunk-size", type=positive_int, default=None,
                        help="prefill the prompt in forwards of at most this many tokens (HF's prefill_chunk_size: "
                             "less activation memory for long prompts; default: the checkpoint's, else one forward)")
    parser.add_argument("--gamma", type=gamma_arg, default=gamma_default,
                        help="draft tokens per iteration, or 'auto' (chosen from the measured acceptance and costs)"
                             + ("" if gamma_default else " (with --draft or --early-exit; default: the checkpoint's "
                                  f"num_assistant_tokens, the target's then the draft's generation_config, else "
                                  f"{DEFAULT_GAMMA})"))
    parser.add_argument("--seed", type=seed_arg, default=0,
                        help="seed of the speculative run's random numbers (generate(seed=...): the same seed, the "
                             "same output); model.generate runs after torch.manual_seed(seed)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help=f"auto ({dtype_auto}), float32, float16 or bfloat16")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton", "cuda"],
                        help="verification kernels (auto: cuda, then triton on a GPU; torch elsewhere)")


def prepare_run(args) -> None:
    """The checks every command makes once its arguments are parsed (see ``UsageError``)."""
    check_sampling_options(args)
    resolve_device(args)
