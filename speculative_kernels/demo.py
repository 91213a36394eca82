"""``speculative-kernels demo``: the bundled target/draft pair completing Python snippets, with and without speculation.

Loads the pair shipped in ``speculative_kernels/demo_models`` (offline), warms both paths up, then for each prompt
times plain ``model.generate`` and ``speculative_kernels.generate`` on the same input and prints both completions,
tokens/s, the speedup, the acceptance rate and the mean tokens per target forward. Greedy outputs must be
token-identical; the command exits with status 1 if they are not.
"""

import argparse
import dataclasses
import sys

from .cli_options import (
    ACCEPTANCE_LEGEND,
    HelpFormatter,
    add_common_options,
    auto_gamma_text,
    check_one_completion,
    completion_ids,
    encode_prompt,
    positive_int,
    prepare_run,
    sampling_kwargs,
)

DESCRIPTION = """\
Run the target/draft pair shipped with the package (offline) on a few built-in Python snippets: each prompt is
completed with plain model.generate and with speculative_kernels.generate, and both completions, tokens/s, the
speedup, the acceptance rate and the mean tokens per target forward are printed. Greedy outputs must be
token-identical: the command exits with status 1 if they are not.
"""

BUILTIN_PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef list_python_files(path):\n",
    "def read_config(filename):\n    \"\"\"Read a configuration file and return a dict.\"\"\"\n",
    "    def __repr__(self):\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items)\n",
)
QUICK_PROMPTS = 2
QUICK_MAX_NEW_TOKENS = 24


@dataclasses.dataclass
class PromptResult:
    prompt: str
    baseline_text: str
    speculative_text: str
    baseline_tokens: int
    speculative_tokens: int
    # each path's tokens, seconds and text are those of its run with the median tokens/s (``timing.median_run``):
    # under sampling, repeats stop at their own EOS, so one run's tokens over the median time would mix runs
    baseline_s: float
    speculative_s: float
    stats: object  # SpeculationStats of that speculative run
    identical: bool  # every repeat's two outputs equal


class Progress:
    """A progress bar over the timed runs: tqdm when installed, else one status line per step on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, file=sys.stderr, leave=False, unit="run")

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _demo_dtype(name: str, device: str) -> str:
    """'auto' -> float32 on every device: the demo checks greedy identity, which is exact in float32 (in half
    precision a near-tie may fall either way, docs/half_precision.md); the stored fp16 is also slow on the CPU, and
    the demo models are too small for their dtype to change GPU timings."""
    return "float32" if name == "auto" else name


def _load_pair(args):
    from .demo_pair import demo_model_paths
    from .model_loading import load_model

    if (args.target is None) != (args.draft is None):
        raise ValueError("pass both --target and --draft, or neither (the bundled pair)")
    target_dir, draft_dir = (args.target, args.draft) if args.target else demo_model_paths()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file "Loading weights" bars would bury the demo's own progress display
    dtype = _demo_dtype(args.dtype, args.device)
    target, tokenizer = load_model(target_dir, device=args.device, dtype=dtype)
    draft, draft_tokenizer = load_model(draft_dir, device=args.device, dtype=dtype)
    if tokenizer is None:
        raise ValueError(f"{target_dir} has no tokenizer")
    check_one_completion(target)
    return target, draft, tokenizer, draft_tokenizer


def _kwargs(args, tokenizer, attention_mask) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return dict(attention_mask=attention_mask, max_new_tokens=args.max_new_tokens, pad_token_id=pad,
                tokenizer=tokenizer, **sampling_kwargs(args))


def _run_prompt(prompt, pair, args, progress, index: int, count: int) -> PromptResult:
    import torch

    from . import SpeculationStats, generate
    from .timing import median_run, timed_generate

    target, draft, tokenizer, draft_tokenizer = pair
    ids, mask = encode_prompt(tokenizer, target, prompt, args.device)
    kwargs = _kwargs(args, tokenizer, mask)
    base_runs, spec_runs = [], []  # per repeat: (new token ids, seconds[, stats])
    for repeat in range(args.repeats):  # interleaved, so both paths see the same machine load
        torch.manual_seed(args.seed + repeat)
        baseline, seconds = timed_generate(lambda: target.generate(ids, **kwargs), args.device)
        base_runs.append((completion_ids(target, ids, baseline), seconds))
        progress.step(f"prompt {index}/{count}: model.generate")
        stats = SpeculationStats()
        output, seconds = timed_generate(
            lambda: generate(target, ids, draft_model=draft, num_speculative_tokens=args.gamma,
                             assistant_tokenizer=draft_tokenizer, speculation_stats=stats, backend=args.backend,
                             seed=(args.seed + repeat) % 2**63, **kwargs),
            args.device,
        )
        spec_runs.append((completion_ids(target, ids, output), seconds, stats))
        progress.step(f"prompt {index}/{count}: speculative")
    base_new, base_s = base_runs[median_run([len(r[0]) for r in base_runs], [r[1] for r in base_runs])]
    spec_new, spec_s, stats = spec_runs[median_run([len(r[0]) for r in spec_runs], [r[1] for r in spec_runs])]
    return PromptResult(
        prompt=prompt,
        baseline_text=tokenizer.decode(base_new, skip_special_tokens=True),
        speculative_text=tokenizer.decode(spec_new, skip_special_tokens=True),
        baseline_tokens=len(base_new), speculative_tokens=len(spec_new),
        baseline_s=base_s, speculative_s=spec_s,
        stats=stats, identical=all(b[0] == s[0] for b, s in zip(base_runs, spec_runs)),
    )


def _warm_up(pair, args, prompt: str) -> None:
    """One short run of each path (allocator, lazy initialisation, first-call dispatch) before any timing."""
    from . import generate

    target, draft, tokenizer, draft_tokenizer = pair
    ids, mask = encode_prompt(tokenizer, target, prompt, args.device)
    kwargs = _kwargs(args, tokenizer, mask)
    kwargs["max_new_tokens"] = min(args.max_new_tokens, 16)
    target.generate(ids, **kwargs)
    gamma = args.gamma if args.gamma != "auto" else 4
    generate(target, ids, draft_model=draft, num_speculative_tokens=gamma, assistant_tokenizer=draft_tokenizer,
             backend=args.backend, **kwargs)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in (text or "(nothing)").splitlines() or [""])


def _report(result: PromptResult, index: int, count: int, args) -> str:
    s = result.stats
    base_rate = result.baseline_tokens / result.baseline_s
    spec_rate = result.speculative_tokens / result.speculative_s
    gamma = (f"gamma auto -> {auto_gamma_text(s.num_speculative_tokens)}" if args.gamma == "auto"
             else f"gamma {args.gamma}")
    return "\n".join([
        f"=== prompt {index}/{count} " + "=" * 60,
        _indent(result.prompt.rstrip("\n")),
        f"--- model.generate: {result.baseline_tokens} tokens, {base_rate:.1f} tokens/s",
        _indent(result.baseline_text),
        f"--- speculative_kernels.generate ({gamma}): {result.speculative_tokens} tokens, {spec_rate:.1f} tokens/s, "
        f"{spec_rate / base_rate:.2f}x; acceptance {s.acceptance_rate:.2f} (alpha {s.alpha:.2f}), "
        f"{s.mean_tokens_per_target_forward:.2f} tokens per target forward",
        _indent(result.speculative_text),
        "--- outputs " + ("identical" if result.identical else
                          "differ" + (" (expected when sampling)" if args.temperature > 0 else " (ERROR: greedy)")),
    ])


def summarize(results: list[PromptResult]) -> dict:
    """Totals over the prompts: tokens/s of each path (total tokens / total seconds of the median runs), speedup,
    acceptance; alpha pools the runs' accept tests (each row-step with the drafts it had: gamma auto's calibration
    iterations at their own gamma, shortened ones at theirs), as ``SpeculationStats.alpha`` does per run."""
    base_tokens = sum(r.baseline_tokens for r in results)
    spec_tokens = sum(r.speculative_tokens for r in results)
    base_rate = base_tokens / sum(r.baseline_s for r in results)
    spec_rate = spec_tokens / sum(r.speculative_s for r in results)
    drafted = sum(r.stats.drafted_tokens for r in results)
    steps = sum(r.stats.verify_steps for r in results)
    emitted = sum(sum((n + 1) * c for n, c in enumerate(r.stats.accepted_histogram)) for r in results)
    successes = sum(r.stats.accept_tests_passed for r in results)
    tests = sum(r.stats.accept_tests for r in results)
    return {
        "prompts": len(results), "baseline_tokens_per_s": base_rate, "speculative_tokens_per_s": spec_rate,
        "speedup": spec_rate / base_rate,
        "acceptance_rate": sum(r.stats.accepted_tokens for r in results) / drafted if drafted else 0.0,
        "tokens_per_target_forward": emitted / steps if steps else 0.0,
        "alpha": successes / tests if tests else 0.0,
        "identical": all(r.identical for r in results),
    }


def run_demo(args) -> int:
    import torch

    prepare_run(args)
    if args.quick:
        args.max_new_tokens = min(args.max_new_tokens, QUICK_MAX_NEW_TOKENS)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    prompts = list(args.prompt) if args.prompt else list(BUILTIN_PROMPTS[: QUICK_PROMPTS if args.quick else None])
    if args.threads is None and args.device == "cpu":
        args.threads = 1  # see --threads
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = _load_pair(args)
    print(f"demo pair: target {sum(p.numel() for p in pair[0].parameters()) / 1e6:.1f}M params, draft "
          f"{sum(p.numel() for p in pair[1].parameters()) / 1e6:.1f}M params; device {args.device}, dtype "
          f"{next(pair[0].parameters()).dtype}, torch threads {torch.get_num_threads()}; "
          f"{'greedy' if args.temperature == 0 else f'sampling at temperature {args.temperature}'}, "
          f"{args.max_new_tokens} new tokens, the run of median tokens/s of {args.repeats} per prompt and path")
    _warm_up(pair, args, prompts[0])
    progress = Progress(2 * args.repeats * len(prompts), enabled=not args.no_progress)
    results = []
    try:
        for i, prompt in enumerate(prompts, 1):
            result = _run_prompt(prompt, pair, args, progress, i, len(prompts))
            results.append(result)
            progress.write(_report(result, i, len(prompts), args))
    finally:
        progress.close()
    total = summarize(results)
    print("=" * 72)
    print(f"model.generate                 {total['baseline_tokens_per_s']:8.1f} tokens/s")
    print(f"speculative_kernels.generate   {total['speculative_tokens_per_s']:8.1f} tokens/s   "
          f"speedup {total['speedup']:.2f}x")
    print(f"acceptance rate {total['acceptance_rate']:.3f}, per-token acceptance alpha "
          f"{total['alpha']:.3f}, {total['tokens_per_target_forward']:.2f} tokens per target forward")
    print(f"({ACCEPTANCE_LEGEND})")
    if args.temperature > 0:
        print("sampled outputs differ by design (each is an exact sample of the target's distribution)")
        return 0
    half = _demo_dtype(args.dtype, args.device) not in ("float32", "fp32")
    print("greedy outputs: " + ("identical" if total["identical"] else
                                f"DIFFER (in {args.dtype} a near-tie can fall either way: docs/half_precision.md; "
                                "--dtype float32 checks identity exactly)" if half else "DIFFER (error)"))
    return 0 if total["identical"] else 1


def add_demo_command(subparsers) -> argparse.ArgumentParser:
    demo = subparsers.add_parser("demo", help="run the bundled target/draft pair: speculative vs plain generate",
                                 description=DESCRIPTION, formatter_class=HelpFormatter)
    add_common_options(demo, max_new_tokens_default=96,
                       dtype_auto="float32 on every device, where greedy identity is exact")
    demo.set_defaults(gamma=4, run=run_demo)
    demo.add_argument("--prompt", action="append",
                      help="a prompt instead of the built-in ones (repeatable)")
    demo.add_argument("--quick", action="store_true",
                      help=f"{QUICK_PROMPTS} prompts, at most {QUICK_MAX_NEW_TOKENS} new tokens, 1 run each (for CI)")
    demo.add_argument("--repeats", type=positive_int,
                      help="timed runs per prompt and path; the one with the median tokens/s is reported "
                           "(default: 3, or 1 with --quick)")
    demo.add_argument("--threads", type=positive_int,
                      help="torch intra-op threads (default: 1 on CPU, where the demo models are too small to gain "
                           "from more and extra threads thrash on shared cores; elsewhere torch's default)")
    demo.add_argument("--no-progress", action="store_true", help="no progress display")
    demo.add_argument("--target", help="another target folder instead of the bundled one (with --draft)")
    demo.add_argument("--draft", help="another draft folder instead of the bundled one (with --target)")
    return demo
