"""HF's logits processors at batch > 1: plain ``model.generate`` against ours, and ours with parts of it taken back
(``--paths``): the processors' fast path ("ours, per-row processors": every processor called per row and position,
as before ``block_processors.py``), the draft's processing ("ours, unprocessed drafts": the draft's logits get the
cheap masks only, as before ``draft_processors.py``).

    OMP_NUM_THREADS=1 python benchmarks/processors_batch.py --clock process --out benchmarks/results/....json
    python benchmarks/processors_batch.py --gamma auto --settings "all three"
    python benchmarks/processors_batch.py --quick          # batch 1 and 4, one repeat, 16 tokens (a smoke test)

The demo pair, greedy, γ --gamma; prompts: ``half_precision.stdlib_prompts`` (two lines of a standard-library
``def``), left-padded with the tokenizer's pad id and its attention mask. Every row generates --max-new-tokens
tokens: EOS off for the repetition penalty alone; with the n-gram ban (and in "all three": the penalty, the ban
and the minimum) the EOS is set and ``min_new_tokens`` equals
--max-new-tokens, so HF's MinLength/MinNewTokens processors run at every step and the EOS is never drawn. Per batch
size and setting, the paths run interleaved --repeats times after one warm-up each (whose outputs are compared with
plain ``generate``: token identity); reported: tokens/s from the median time, the ratio to plain ``generate`` and
ours' to each path's time, and for ours the time in ``RowProcessors.process`` per iteration (median over the runs
of each run's mean), the acceptance rate (accepted / drafted tokens of the warm-up call) and the gamma it ended
at. ``--profile`` prints a cProfile of the paths at the largest batch instead. A markdown table on stdout, JSON
under --out.
"""

import argparse
import cProfile
import contextlib
import datetime
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from half_precision import stdlib_prompts  # noqa: E402
from harness import cpu_name  # noqa: E402
import speculative_kernels as sk  # noqa: E402
from speculative_kernels.demo_pair import load_demo_pair  # noqa: E402
from speculative_kernels.generation import context_processors, draft_processors  # noqa: E402


def settings(eos: int, max_new_tokens: int) -> dict:
    """name -> generate keywords (besides the common ones)."""
    return {
        "repetition_penalty=1.05": dict(repetition_penalty=1.05, eos_token_id=None),
        "no_repeat_ngram_size=3, min_new_tokens": dict(no_repeat_ngram_size=3, eos_token_id=eos,
                                                       min_new_tokens=max_new_tokens),
        "all three": dict(repetition_penalty=1.05, no_repeat_ngram_size=3, eos_token_id=eos,
                          min_new_tokens=max_new_tokens),
    }


@contextlib.contextmanager
def per_row_only():
    """Ours without the fast path: every processor called per row and position (the code before it)."""
    split = context_processors.split_into_stages
    context_processors.split_into_stages = lambda processors: [(False, tuple(processors))] if processors else []
    try:
        yield
    finally:
        context_processors.split_into_stages = split


@contextlib.contextmanager
def processing_clock(spent: list):
    """Adds each ``RowProcessors.process`` call's seconds (--clock's) to ``spent``."""
    process = context_processors.RowProcessors.process

    def timed(self, *args):
        start = _now()
        try:
            return process(self, *args)
        finally:
            spent.append(_now() - start)

    context_processors.RowProcessors.process = timed
    try:
        yield
    finally:
        context_processors.RowProcessors.process = process


def _now() -> float:
    return time.process_time() if CLOCK == "process" else time.perf_counter()


@contextlib.contextmanager
def unprocessed_drafts():
    """Ours with the draft's logits left unprocessed (the code before ``draft_processors.py``)."""
    start = draft_processors.DraftProcessors.start
    draft_processors.DraftProcessors.start = classmethod(lambda cls, *args: None)
    try:
        yield
    finally:
        draft_processors.DraftProcessors.start = start


PATHS = {"ours, per-row processors": per_row_only, "ours, unprocessed drafts": unprocessed_drafts}


def paths(target, draft, gamma, common: dict, stats: list, others: list) -> dict:
    """name -> fn(ids, mask) -> sequences: plain generate, ours, and ours under each of ``others`` (``PATHS``).
    stats: each call of ours appends its SpeculationStats."""

    def ours(ids, mask):
        stats.append(sk.SpeculationStats())
        return sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=gamma,
                           speculation_stats=stats[-1], **common)

    def variant(context):
        def run(ids, mask):
            with context():
                return ours(ids, mask)
        return run

    runs = {"plain generate": lambda ids, mask: target.generate(ids, attention_mask=mask, **common), "ours": ours}
    runs.update({name: variant(PATHS[name]) for name in others})
    return runs


def run_case(runs: dict, ids, mask, repeats: int, stats: list) -> dict:
    """Per path: tokens, median seconds, tok/s, same as plain, and for ours the median over runs of the mean
    seconds per ``RowProcessors.process`` call (one per iteration); each of ours' acceptance and the gamma it
    ended at (its warm-up call)."""
    outputs, accepted = {}, {}
    for name, fn in runs.items():  # (warm-up)
        before = len(stats)
        outputs[name] = fn(ids, mask)
        if len(stats) > before:
            accepted[name] = (stats[-1].accepted_tokens / max(stats[-1].drafted_tokens, 1),
                              stats[-1].num_speculative_tokens, stats[-1].target_forwards)
    times = {name: [] for name in runs}
    processing = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            spent = []
            with processing_clock(spent):
                start = _now()
                fn(ids, mask)
                times[name].append(_now() - start)
            if spent:
                processing[name].append(sum(spent) / len(spent))
    result = {}
    for name in runs:
        tokens = outputs[name].numel() - ids.numel()
        seconds = statistics.median(times[name])
        result[name] = {"tokens": tokens, "seconds": seconds, "times": times[name], "tok_s": tokens / seconds,
                        "same_as_plain": torch.equal(outputs[name], outputs["plain generate"])}
        if processing[name]:
            result[name]["process_ms"] = 1e3 * statistics.median(processing[name])
    for name in runs:
        result[name]["x_plain"] = result[name]["tok_s"] / result["plain generate"]["tok_s"]
        result[name]["x_ours"] = result["ours"]["seconds"] / result[name]["seconds"]
        if name in accepted:
            result[name]["acceptance_rate"], result[name]["gamma_at_end"], result[name]["target_forwards"] = \
                accepted[name]
    return result


def table(results: list) -> str:
    lines = ["| batch | setting | path | tok/s | × plain | ours ÷ path | processors, ms per iteration | same as plain "
             "| acceptance | γ at the end |",
             "|---:|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        for name, row in r["paths"].items():
            accept = f"{row['acceptance_rate']:.3f}" if "acceptance_rate" in row else ""
            spent = f"{row['process_ms']:.2f}" if "process_ms" in row else ""
            lines.append(f"| {r['batch']} | {r['setting']} | {name} | {row['tok_s']:.1f} | {row['x_plain']:.2f} | "
                         f"{row['x_ours']:.2f} | {spent} | {'yes' if row['same_as_plain'] else 'NO'} | {accept} | "
                         f"{row.get('gamma_at_end', '')} |")
    return "\n".join(lines)


CLOCK = "wall"


def main(argv=None) -> int:
    global CLOCK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--gamma", type=lambda v: v if v == "auto" else int(v), default=4, help="an int or auto")
    parser.add_argument("--paths", nargs="*", default=["ours, unprocessed drafts"], choices=list(PATHS),
                        help="ours under these besides plain generate and ours")
    parser.add_argument("--settings", nargs="*", default=None, help="names of the settings to run (default all)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="process: this process's CPU time (a machine shared with other jobs)")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4, one repeat, 16 new tokens")
    parser.add_argument("--profile", action="store_true", help="cProfile ours per-row at the largest batch")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.repeats, args.max_new_tokens = [1, 4], 1, 16
    CLOCK = args.clock
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_demo_pair()
    tokenizer.padding_side = "left"
    encoded = tokenizer(stdlib_prompts(max(args.batch)), return_tensors="pt", padding=True)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    cases = settings(tokenizer.eos_token_id, args.max_new_tokens)
    results = []
    with torch.inference_mode():
        if args.profile:
            return profile(target, draft, encoded, max(args.batch), args, common, cases)
        for batch in args.batch:
            ids, mask = encoded.input_ids[:batch], encoded.attention_mask[:batch]
            for name, setting in cases.items():
                if args.settings and name not in args.settings:
                    continue
                stats = []
                runs = paths(target, draft, args.gamma, {**common, **setting}, stats, args.paths)
                results.append({"batch": batch, "setting": name,
                                "paths": run_case(runs, ids, mask, args.repeats, stats)})
                print(f"batch {batch}, {name}: done", file=sys.stderr, flush=True)
    print(table(results))
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                "machine": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "args": vars(args), "command": " ".join(sys.argv)}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if all(p["same_as_plain"] for r in results for p in r["paths"].values()) else 1


def profile(target, draft, encoded, batch: int, args, common: dict, cases: dict) -> int:
    """cProfile of ours with per-row processors and with the fast path, each setting, at ``batch``."""
    ids, mask = encoded.input_ids[:batch], encoded.attention_mask[:batch]
    for name, setting in cases.items():
        runs = paths(target, draft, args.gamma, {**common, **setting}, [], args.paths)
        for path in (*args.paths, "ours"):
            runs[path](ids, mask)
            profiler = cProfile.Profile()
            profiler.runcall(runs[path], ids, mask)
            print(f"=== {name}: {path}, batch {batch}")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
