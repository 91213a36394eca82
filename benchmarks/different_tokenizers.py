"""A draft with another tokenizer (universal assisted generation) against the same draft on the shared vocabulary.

    python benchmarks/different_tokenizers.py                 # the demo pair on CPU, greedy, batch 1
    python benchmarks/different_tokenizers.py --quick         # two prompts, one repeat (a smoke test)

The demo pair's draft, given to the target twice: as it is (one shared vocabulary: ``ModelDrafter``), and under a
permuted vocabulary with 8 more ids (the same tokens under other ids, its embedding and head rows moved with them:
``helpers.tiny_tokenizers.permuted``/``permuted_model``), with ``tokenizer=`` and ``assistant_tokenizer=`` (the
re-tokenizing drafter; HF's universal assisted generation, whose check wants the vocab sizes to differ). The two
compute the same draft distribution, so what separates them is the path: the host re-tokenization, the draft read,
and the drafts lost where the draft sees the canonical tokenization of the text and the target emitted another.

Paths (greedy, batch 1, stdlib prompts, EOS off so every path generates --max-new-tokens): plain
``model.generate``; HF's assisted generation with the shared draft; HF's UAD with the permuted draft; ours with the
shared draft; ours with the permuted draft. Per path: tokens/s (total tokens / total of each prompt's median time
over --repeats runs, the paths interleaved within each repeat, after one warm-up each), speedup over plain, tokens
per target forward (ours: from the statistics) and acceptance (accepted / drafted), and whether the output is
token-identical to plain greedy. A markdown table on stdout and JSON under --out.
"""

import argparse
import datetime
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
from harness import cpu_name  # noqa: E402
import speculative_kernels as sk  # noqa: E402
from speculative_kernels.demo_pair import load_demo_pair  # noqa: E402
from speculative_kernels.timing import timed_generate  # noqa: E402
from helpers.tiny_tokenizers import permutation, permuted, permuted_model  # noqa: E402

FUNCTIONS = ["textwrap.indent", "shutil.copyfileobj", "fnmatch.filter", "string.capwords", "colorsys.hls_to_rgb",
             "glob.escape"]
EXTRA = 8  # more draft ids than the target's: HF's UAD runs only where the vocab sizes differ


def _prompt(name: str, lines: int = 3) -> str:
    module, attr = name.rsplit(".", 1)
    source = inspect.getsource(getattr(__import__(module, fromlist=[attr]), attr))
    return "".join(source.splitlines(keepends=True)[:lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="process: this process's CPU time (what holds on a shared CPU)")
    parser.add_argument("--out", default=str(HERE / "results" / "different-tokenizers-demo-cpu.json"))
    args = parser.parse_args()
    clock = time.process_time if args.clock == "process" else time.perf_counter
    torch.manual_seed(0)
    target, draft, tokenizer = load_demo_pair()
    perm = permutation(len(tokenizer), fixed=3, seed=0)  # (the demo tokenizer's specials: ids 0, 1, 2)
    other_tokenizer = permuted(tokenizer, perm, extra=tuple(f"<|extra{k}|>" for k in range(EXTRA)))
    other_draft = permuted_model(draft, perm, extra=EXTRA)
    names = FUNCTIONS[:2] if args.quick else FUNCTIONS
    repeats = 1 if args.quick else args.repeats
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id)
    uad = dict(tokenizer=tokenizer, assistant_tokenizer=other_tokenizer)
    paths = {
        "plain model.generate": lambda ids, s: target.generate(ids, **common),
        "HF assisted, shared vocabulary": lambda ids, s: target.generate(ids, assistant_model=draft, **common),
        "HF UAD, other tokenizer": lambda ids, s: target.generate(ids, assistant_model=other_draft, **uad, **common),
        "ours, shared vocabulary": lambda ids, s: sk.generate(target, ids, draft_model=draft, speculation_stats=s,
                                                              num_speculative_tokens=args.gamma, **common),
        "ours, other tokenizer": lambda ids, s: sk.generate(target, ids, assistant_model=other_draft,
                                                            speculation_stats=s, num_speculative_tokens=args.gamma,
                                                            **uad, **common),
    }
    times = {p: {n: [] for n in names} for p in paths}
    counts = {p: {"tokens": 0, "new": 0, "forwards": 0, "accepted": 0, "drafted": 0, "identical": True}
              for p in paths}
    prompts = {n: tokenizer(_prompt(n), return_tensors="pt").input_ids for n in names}
    with torch.inference_mode():
        plain = {n: target.generate(prompts[n], **common) for n in names}
        for n in names:  # warm-up, one run per path
            for p, run in paths.items():
                run(prompts[n], sk.SpeculationStats())
        for _ in range(repeats):
            for n in names:
                for p, run in paths.items():
                    stats = sk.SpeculationStats()
                    out, seconds = timed_generate(lambda: run(prompts[n], stats), "cpu", clock)
                    times[p][n].append(seconds)
                    c = counts[p]
                    c["identical"] &= torch.equal(out, plain[n])
                    if _ == 0:
                        c["new"] += out.shape[1] - prompts[n].shape[1]
                        c["forwards"] += stats.target_forwards
                        c["accepted"] += stats.accepted_tokens
                        c["drafted"] += stats.drafted_tokens
    rows = []
    base = sum(statistics.median(times["plain model.generate"][n]) for n in names)
    for p in paths:
        total = sum(statistics.median(times[p][n]) for n in names)
        c = counts[p]
        ours = p.startswith("ours")
        rows.append(dict(path=p, tokens_per_s=c["new"] / total, seconds=total, speedup=base / total,
                         tokens_per_target_forward=c["new"] / c["forwards"] if ours and c["forwards"] else None,
                         acceptance=c["accepted"] / c["drafted"] if ours and c["drafted"] else None,
                         identical=c["identical"]))
    print("| path | tok/s | speedup vs plain | tok/target fwd | acceptance | identical |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        fmt = (lambda v: "-" if v is None else f"{v:.2f}")
        print(f"| {r['path']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {fmt(r['tokens_per_target_forward'])} | "
              f"{fmt(r['acceptance'])} | {r['identical']} |")
    record = dict(date=datetime.date.today().isoformat(), machine=cpu_name(), python=platform.python_version(),
                  torch=torch.__version__, transformers=transformers.__version__, clock=args.clock,
                  command=" ".join(sys.argv), prompts=names, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                  repeats=repeats, rows=rows)
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
