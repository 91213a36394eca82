"""When to compact a batch's caches: ``SlotCompactor.due``'s rule before (compact when the holes pass the threshold
of the used slots) against now (when compacting frees more than that: the width past the longest row), paired in
one process on the demo pair, greedy, γ = 4, 64 new tokens per row, left-padded ``half_precision.stdlib_prompts``.

    OMP_NUM_THREADS=1 python benchmarks/compaction_rule.py --batch 16 --out benchmarks/results/compaction-rule-cpu.json

Per setting: --repeats interleaved runs of each rule after one warm-up round (dropped), this process's CPU time,
medians, the ratio before / after, and each rule's compaction count; every output compared with plain
``model.generate`` (token identity).
"""

import argparse
import datetime
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
sys.path.insert(0, str(HERE))
from half_precision import stdlib_prompts  # noqa: E402
from harness import cpu_name  # noqa: E402
import speculative_kernels as sk  # noqa: E402
from speculative_kernels.demo_pair import load_demo_pair  # noqa: E402
from speculative_kernels.generation.runners import compaction  # noqa: E402

AFTER = compaction.SlotCompactor.due


def before(self, used, reserve=0, capacity=None):
    """The rule before: compact when holes exceed the threshold of the used slots."""
    counts, self._counts = self._counts, None
    full = capacity is not None and used + reserve > capacity
    if counts is None or not self.enabled or used == 0:
        return None
    real = [min(max(c, 0), used) for c in counts]
    holes = len(real) * used - sum(real)
    if not full and holes <= self.threshold * len(real) * used:
        return None
    return max(real)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target, draft, tokenizer = load_demo_pair()
    tokenizer.padding_side = "left"
    encoded = tokenizer(stdlib_prompts(args.batch), return_tensors="pt", padding=True)
    ids, mask = encoded.input_ids, encoded.attention_mask
    settings = {"no_repeat_ngram_size=3, min_new_tokens": dict(no_repeat_ngram_size=3, min_new_tokens=64,
                                                              eos_token_id=tokenizer.eos_token_id),
                "repetition_penalty=1.05": dict(repetition_penalty=1.05, eos_token_id=None)}
    results, same = {}, True
    with torch.inference_mode():
        for name, setting in settings.items():
            common = dict(max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.pad_token_id, **setting)
            plain = target.generate(ids, attention_mask=mask, **common)
            times, counts = {"before": [], "after": []}, {}
            for repeat in range(args.repeats + 1):
                for rule, due in (("before", before), ("after", AFTER)):
                    compaction.SlotCompactor.due = due
                    stats = sk.SpeculationStats()
                    start = time.process_time()
                    out = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=4,
                                      speculation_stats=stats, **common)
                    seconds = time.process_time() - start
                    compaction.SlotCompactor.due = AFTER
                    same = same and torch.equal(out, plain)
                    if repeat:
                        times[rule].append(seconds)
                    counts[rule] = stats.compactions
            medians = {rule: statistics.median(t) for rule, t in times.items()}
            results[name] = {"times": times, "median_s": medians, "compactions": counts,
                             "before_over_after": medians["before"] / medians["after"]}
            print(f"| {args.batch} | {name} | {medians['before']:.3f} | {medians['after']:.3f} | "
                  f"{medians['before'] / medians['after']:.3f} | {counts['before']} → {counts['after']} |", flush=True)
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                "machine": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "args": vars(args), "command": " ".join(sys.argv),
                "same_as_plain": same}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
