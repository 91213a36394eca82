"""What HF's logits processors over the sequence so far cost speculative decoding (``generation/context_processors.py``).

    python benchmarks/processors.py                      # the demo pair on CPU, greedy, batch 1
    python benchmarks/processors.py --quick              # one prompt, one repeat (a smoke test)

For each setting (none; ``repetition_penalty=1.05``, the Qwen2.5 instruct checkpoints' default; that with
``no_repeat_ngram_size=3``, whose HF processor reads the sequence on the host): plain ``model.generate``, HF's
assisted generation with the demo draft (``assistant_model=``, which runs the same processors per candidate
position), and ours with the demo draft (gamma --gamma). Per path: tokens/s (total tokens / sum over prompts of each
prompt's median time over --repeats runs; the paths interleaved within each repeat, after one warm-up run each),
the speedup over plain ``generate`` with the same setting, whether the output is token-identical to it, and for
ours the acceptance rate (accepted / drafted tokens, over the prompts' warm-up runs: greedy, so deterministic).
A markdown table on stdout, JSON under --out.
"""

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from harness import cpu_name  # noqa: E402
import speculative_kernels as sk  # noqa: E402
from speculative_kernels.demo import BUILTIN_PROMPTS  # noqa: E402
from speculative_kernels.demo_pair import load_demo_pair  # noqa: E402
from speculative_kernels.timing import timed_generate  # noqa: E402

SETTINGS = {
    "none": {},
    "repetition_penalty=1.05": {"repetition_penalty": 1.05},
    "repetition_penalty=1.05, no_repeat_ngram_size=3": {"repetition_penalty": 1.05, "no_repeat_ngram_size": 3},
}


def paths(target, draft, gamma: int, max_new_tokens: int, settings: dict, stats_log: list) -> dict:
    """name -> fn(ids) -> sequences [1, L + new]; greedy, EOS off (every path generates max_new_tokens). stats_log:
    a list each call of ours appends its own SpeculationStats to (``generate`` overwrites the stats it is given)."""
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **settings)

    def ours(ids):
        stats_log.append(sk.SpeculationStats())
        return sk.generate(target, ids, draft_model=draft, num_speculative_tokens=gamma,
                           speculation_stats=stats_log[-1], **common)

    return {
        "plain generate": lambda ids: target.generate(ids, **common),
        "HF assisted": lambda ids: target.generate(ids, assistant_model=draft, num_assistant_tokens=gamma,
                                                   num_assistant_tokens_schedule="constant", **common),
        "ours": ours,
    }


def run_setting(prompts, runs: dict, repeats: int, stats_log: list) -> dict:
    """Per path: tokens, seconds (sum of per-prompt medians), tok/s, identical to plain; ours' acceptance rate over
    every prompt (accepted over drafted tokens, summed over the warm-up pass's calls, one per prompt)."""
    times = {name: [[] for _ in prompts] for name in runs}
    outputs = {}
    for name, fn in runs.items():  # warm-up, and the outputs compared
        outputs[name] = [fn(ids) for ids in prompts]
    calls = stats_log[: len(prompts)]
    acceptance = sum(s.accepted_tokens for s in calls) / max(sum(s.drafted_tokens for s in calls), 1)
    for _ in range(repeats):
        for p, ids in enumerate(prompts):
            for name, fn in runs.items():
                _, seconds = timed_generate(lambda: fn(ids), "cpu")
                times[name][p].append(seconds)
    result = {}
    for name in runs:
        tokens = sum(o.shape[1] - ids.shape[1] for o, ids in zip(outputs[name], prompts))
        seconds = sum(statistics.median(t) for t in times[name])
        same = all(torch.equal(a, b) for a, b in zip(outputs[name], outputs["plain generate"]))
        result[name] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "same_as_plain": same}
    for name in runs:
        result[name]["x_plain"] = result[name]["tok_s"] / result["plain generate"]["tok_s"]
    result["ours"]["acceptance_rate"] = acceptance
    return result


def table(results: dict) -> str:
    lines = ["| setting | path | tok/s | × plain (same setting) | same as plain | acceptance |",
             "|---|---|---:|---:|---|---:|"]
    for setting, rows in results.items():
        for name, r in rows.items():
            accept = f"{r['acceptance_rate']:.3f}" if "acceptance_rate" in r else ""
            lines.append(f"| {setting} | {name} | {r['tok_s']:.1f} | {r['x_plain']:.2f} | "
                         f"{'yes' if r['same_as_plain'] else 'NO'} | {accept} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one prompt, one repeat, 16 new tokens")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats, args.max_new_tokens = 1, 1, 16
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_demo_pair()
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in BUILTIN_PROMPTS[: args.prompts]]
    results = {}
    with torch.inference_mode():
        for setting, settings in SETTINGS.items():
            stats_log = []
            results[setting] = run_setting(prompts, paths(target, draft, args.gamma, args.max_new_tokens, settings,
                                                          stats_log), args.repeats, stats_log)
            print(f"{setting}: done", file=sys.stderr, flush=True)
    print(table(results))
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                "machine": cpu_name(), "python": platform.python_version(),
                "torch": torch.__version__, "transformers": transformers.__version__, "args": vars(args)}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if all(r["same_as_plain"] for rows in results.values() for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
