"""Speculation without a draft model: prompt lookup and the n-gram drafter, against plain and HF generation.

    python benchmarks/prompt_lookup.py                    # the demo target on CPU, greedy, one run
    python benchmarks/prompt_lookup.py --quick            # one prompt per task (a smoke test)

Tasks (the bundled demo target, trained on the Python standard library; prompts are stdlib source):
* ``edit`` (input-grounded): a stdlib function, then the same function with its name changed, cut after its
  first line: the model re-emits the body;
* ``repeat`` (input-grounded): the first lines of a stdlib module, then the same lines again, cut early: the model
  continues a file whose earlier half repeats;
* ``free``: the first line of another stdlib function alone (little to copy).

Paths, on the same prompts (greedy, batch 1, --max-new-tokens, EOS off so every path generates the same count):
plain ``model.generate``; HF prompt lookup (``model.generate(prompt_lookup_num_tokens=K)``); ours with prompt
lookup (our default rule: the most recent match, extended periodically; and HF's rule); ours with the n-gram drafter (the paper's bigram); ours with the
demo draft model. Per path: tokens/s (total tokens / total of each prompt's median time over --repeats runs, the
paths interleaved within each repeat, after one warm-up run each), tokens per target forward
(every target forward counted, the prefill included, for HF too: a forward hook counts them), the speedups over
plain and over HF's prompt lookup, the acceptance rate (ours: accepted / proposed drafts, fillers not counted),
alpha for the drafters with a fixed gamma (the ML estimate from the accept tests, ``SpeculationStats.alpha``;
prompt lookup's gamma follows the proposals, so it has none) and whether the output is token-identical to plain greedy. Then the edit prompts as one left-padded batch (tok/fwd per row; HF's
prompt lookup refuses batches). A markdown table on stdout and JSON under --out.
"""

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from harness import cpu_name, hf_compile_config  # noqa: E402
import speculative_kernels as sk  # noqa: E402
from speculative_kernels.timing import timed_generate  # noqa: E402
from speculative_kernels.demo_pair import load_demo_pair  # noqa: E402

# Functions of 100 to 200 tokens: two copies and the new tokens fit the demo target's 512 positions.
FUNCTIONS = ["textwrap.indent", "shutil.copyfileobj", "fnmatch.filter", "string.capwords"]
FREE = ["colorsys.hls_to_rgb", "glob.escape", "base64.b64encode", "calendar.monthrange"]
MODULES = ["colorsys", "bisect", "fnmatch", "keyword"]


def _function_prompt(name: str) -> str:
    module, attr = name.rsplit(".", 1)
    source = inspect.getsource(getattr(__import__(module, fromlist=[attr]), attr))
    edited = source.replace(f"def {attr}(", f"def {attr}_v2(", 1)
    return source + "\n\n" + edited.splitlines(keepends=True)[0]


def _module_prompt(name: str, tokenizer, tokens: int = 160) -> str:
    source = inspect.getsource(__import__(name))
    ids = tokenizer(source)["input_ids"][:tokens]
    head = tokenizer.decode(ids, skip_special_tokens=True)
    return head + "\n" + head[: len(head) // 3]


def _free_prompt(name: str) -> str:
    module, attr = name.rsplit(".", 1)
    return inspect.getsource(getattr(__import__(module, fromlist=[attr]), attr)).splitlines(keepends=True)[0]


def tasks(tokenizer, quick: bool) -> dict:
    n = 1 if quick else None
    return {
        "edit": [_function_prompt(f) for f in FUNCTIONS[:n]],
        "repeat": [_module_prompt(m, tokenizer) for m in MODULES[:n]],
        "free": [_free_prompt(f) for f in FREE[:n]],
    }


class ForwardCounter:
    """Counts the target's forward calls (HF's paths report no statistics of their own). Removed for the compiled
    phase: a compiled step traces the hook, and its guard on ``calls`` fails at every call (a recompile per call)."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_hook(sk.per_token_hook(self._hook))  # counts calls only

    def _hook(self, module, args, output):
        self.calls += 1


def paths(target, draft, k: int, ngram: int, gamma: int, max_new_tokens: int, compiled: bool = False) -> dict:
    """name -> fn(ids, mask, stats) running one path; stats is a SpeculationStats for ours, None for HF's.
    compiled: the compiled phase's paths instead: plain ``model.generate`` eager and on HF's static cache compiled
    (HF's own compiled decoding, which it allows on the CPU through ``CompileConfig``; its prompt lookup refuses a
    static cache), HF's prompt lookup, ours with prompt lookup eager and with ``compile=True``."""
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=2)

    def ours(**extra):
        return lambda ids, mask, stats: sk.generate(target, ids, attention_mask=mask, speculation_stats=stats,
                                                   **common, **extra)

    runs = {
        "plain generate": lambda ids, mask, stats: target.generate(ids, attention_mask=mask, **common),
        f"HF prompt lookup (K={k})": lambda ids, mask, stats: target.generate(
            ids, attention_mask=mask, prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram, **common),
        f"ours, prompt lookup (K={k})": ours(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram),
        f"ours, prompt lookup, HF's rule (K={k})": lambda ids, mask, stats: sk.generate(
            target, ids, attention_mask=mask, speculation_stats=stats, num_speculative_tokens=k,
            drafter=sk.PromptLookupDrafter(k, ngram, max_new_tokens=max_new_tokens, prefer_latest=False,
                                           periodic=False), **common),
        f"ours, bigram drafter (γ={gamma})": lambda ids, mask, stats: sk.generate(
            target, ids, attention_mask=mask, speculation_stats=stats, num_speculative_tokens=gamma,
            drafter=sk.NGramDrafter.for_model(target, order=2), **common),
        f"ours, demo draft model (γ={gamma})": ours(draft_model=draft, num_speculative_tokens=gamma),
    }
    if compiled:  # (the compiled phase: see main)
        hf_compile = hf_compile_config()
        runs = {name: runs[name] for name in ("plain generate", f"HF prompt lookup (K={k})",
                                             f"ours, prompt lookup (K={k})")}
        runs["plain generate, HF static cache compiled"] = lambda ids, mask, stats: target.generate(
            ids, attention_mask=mask, cache_implementation="static", compile_config=hf_compile, **common)
        runs[f"ours, prompt lookup, compile=True (K={k})"] = ours(prompt_lookup_num_tokens=k,
                                                                  max_matching_ngram_size=ngram, compile=True)
    return runs


_clock = time.perf_counter  # set by --clock


def run_task(prompts, runs: dict, tokenizer, counter: ForwardCounter | None, repeats: int) -> dict:
    """The paths on each prompt, interleaved. Without a counter (the compiled phase), target forwards come from our
    statistics, and plain decoding's are its new tokens (one forward each); HF's prompt lookup's are not known."""
    results = {name: {"seconds": 0.0, "tokens": 0, "forwards": 0, "identical": True, "tests": [0, 0]}
               for name in runs}
    for text in prompts:
        encoded = tokenizer(text, return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        reference = None
        for run in runs.values():
            run(ids, mask, sk.SpeculationStats())  # warm-up
        times, last = {name: [] for name in runs}, {}
        for _ in range(repeats):  # the paths interleaved, so a change of the machine's load hits them alike
            for name, run in runs.items():
                stats = sk.SpeculationStats()
                if counter is not None:
                    counter.calls = 0
                out, seconds = timed_generate(lambda: run(ids, mask, stats), "cpu", _clock)
                times[name].append(seconds)
                calls = counter.calls if counter is not None else (
                    stats.target_forwards + stats.prefill_forwards if name.startswith("ours")
                    else out.shape[1] - ids.shape[1] if name.startswith("plain") else None)
                last[name] = (out, stats, calls)
        for name in runs:
            out, stats, calls = last[name]
            r = results[name]
            new = out.shape[1] - ids.shape[1]
            r["seconds"] += statistics.median(times[name])
            r["tokens"] += new
            r["forwards"] = None if calls is None or r["forwards"] is None else r["forwards"] + calls  # (the last repeat's)
            r["accepted"] = r.get("accepted", 0) + stats.accepted_tokens
            r["drafted"] = r.get("drafted", 0) + stats.drafted_tokens
            if reference is None:
                reference = out
            r["identical"] &= torch.equal(out, reference)
            r["tests"] = [r["tests"][0] + stats.accept_tests_passed, r["tests"][1] + stats.accept_tests]
    for name, r in results.items():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["tokens_per_target_forward"] = None if r["forwards"] is None else r["tokens"] / max(r["forwards"], 1)
        passed, tests = r.pop("tests")
        fixed_gamma = "drafter" in name or "draft model" in name
        r["alpha"] = passed / tests if tests and fixed_gamma else None
        r["accept_rate"] = r["accepted"] / r["drafted"] if r.get("drafted") else None
    return results


def run_batched(prompts, runs: dict, tokenizer, counter: ForwardCounter, repeats: int) -> dict:
    """The prompts as one left-padded batch, for the paths that take a batch (HF's prompt lookup is batch 1 only)."""
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    results, reference = {}, None
    for name, run in runs.items():
        if name.startswith("HF prompt lookup"):
            continue
        run(ids, mask, sk.SpeculationStats())  # warm-up
        times = []
        for _ in range(repeats):
            stats = sk.SpeculationStats()
            counter.calls = 0
            out, seconds = timed_generate(lambda: run(ids, mask, stats), "cpu", _clock)
            times.append(seconds)
        reference = out if reference is None else reference
        tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        results[name] = {"seconds": statistics.median(times), "tokens": tokens, "forwards": counter.calls,
                         "identical": torch.equal(out, reference), "tokens_per_s": tokens / statistics.median(times),
                         "tokens_per_target_forward": tokens / ids.shape[0] / max(counter.calls, 1),
                         "accept_rate": stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else None,
                         "alpha": None}
    return results


def table(all_results: dict, k: int) -> str:
    lines = ["| task | path | tok/s | tok/fwd | accept rate | α | × plain | × HF lookup | same as plain |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for task, results in all_results.items():
        plain = results["plain generate"]["tokens_per_s"]
        hf = results.get(f"HF prompt lookup (K={k})", {}).get("tokens_per_s")
        for name, r in results.items():
            alpha = "" if r["alpha"] is None else f"{r['alpha']:.2f}"
            rate = "" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
            per_forward = "" if r["tokens_per_target_forward"] is None else f"{r['tokens_per_target_forward']:.2f}"
            lines.append(f"| {task} | {name} | {r['tokens_per_s']:.1f} | {per_forward} | "
                         f"{rate} | {alpha} | {r['tokens_per_s'] / plain:.2f} | "
                         f"{'n/a' if hf is None else format(r['tokens_per_s'] / hf, '.2f')} | "
                         f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=10, help="prompt_lookup_num_tokens (HF's examples use 10)")
    parser.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size (HF's default 2)")
    parser.add_argument("--gamma", type=int, default=4, help="gamma of the bigram drafter and the draft model")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--compiled", choices=("no", "also", "only"), default="no",
                        help="a compiled phase after the main one (also) or alone (only): plain generate eager and "
                             "on HF's compiled static cache, HF's prompt lookup, ours eager and with compile=True, "
                             "interleaved, without the forward-counting hook (each prompt's first call of a "
                             "compiled path compiles: about 20-40 s on the CPU)")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="process: this process's CPU time (a machine shared with other work)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--name", help="JSON file stem (default: prompt-lookup-demo-cpu-<date>, and -quick with "
                                       "--quick): a run never replaces a recorded table's file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global _clock
    _clock = time.process_time if args.clock == "process" else time.perf_counter
    target, draft, tokenizer = load_demo_pair()
    counter = ForwardCounter(target)
    runs = paths(target, draft, args.k, args.ngram, args.gamma, args.max_new_tokens)
    load_before = os.getloadavg()
    results = {}
    with torch.inference_mode():
        prompts = tasks(tokenizer, args.quick)
        if args.compiled != "only":
            results = {task: run_task(p, runs, tokenizer, counter, args.repeats) for task, p in prompts.items()}
            results[f"edit, batch {len(prompts['edit'])}"] = run_batched(prompts["edit"], runs, tokenizer, counter,
                                                                          args.repeats)
        if args.compiled != "no":
            counter.handle.remove()
            compiled = paths(target, draft, args.k, args.ngram, args.gamma, args.max_new_tokens, compiled=True)
            for task, p in prompts.items():
                results[f"{task}, compiled phase"] = run_task(p, compiled, tokenizer, None, args.repeats)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "load_average_before": load_before,
           "load_average_after": os.getloadavg(), "command": "python benchmarks/prompt_lookup.py " + " ".join(
               sys.argv[1:] if argv is None else argv), "args": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(env))
    print(table(results, args.k))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or (f"prompt-lookup-demo-cpu-{env['date'][:10]}" + ("-quick" if args.quick else ""))
    (args.out / f"{stem}.json").write_text(json.dumps({"environment": env, "results": results},
                                                                     indent=1))
    identical = all(r["identical"] for task in results.values() for r in task.values())
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
