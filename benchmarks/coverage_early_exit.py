"""Early-exit coverage (``assistant_early_exit``, ``generation/early_exit.py``): every architecture of
``coverage.py``'s sweep (the same tiny random configs: 2 decoder layers, sliding windows of 6 over 10-token prompts)
drafting with its own first layer, against ``model.generate``.

Cells per architecture: batch 1 and a left-padded batch of 2 on the dynamic cache, the padded batch on the static
cache; each "exact" (greedy token-identical, with the acceptance rate shown), "refused: ..." (a ValueError/TypeError
naming the reason before anything runs: the architecture's own refusal for any draft, or early exit's), "not
checked: ..." (the tiny model or model.generate itself cannot run) or "DIFFERENT" / "ERROR: ..." (a defect).

    python benchmarks/coverage_early_exit.py --out benchmarks/results/coverage-early-exit.jsonl   # ~5 min, 2 cores
    python benchmarks/coverage_early_exit.py --only llama,gpt2 --out /tmp/ee.jsonl
    python benchmarks/coverage_early_exit.py --summary benchmarks/results/coverage-early-exit.jsonl
"""

import argparse
import collections
import json
import signal
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import coverage  # noqa: E402  (benchmarks/coverage.py: the sweep's models and prompts)

CELLS = (("batch1", 1, {}), ("batch2", 2, {}), ("batch2_static", 2, {"cache_implementation": "static"}))


def _cell(target, batch: int, extra: dict) -> str:
    import torch

    import speculative_kernels as sk

    ids, mask = coverage._inputs(batch)
    common = dict(max_new_tokens=coverage.NEW, do_sample=False, pad_token_id=0, attention_mask=mask)
    try:
        with torch.no_grad():
            expected = target.generate(ids, **common)
    except Exception as error:  # noqa: BLE001
        coverage._reraise_timeout(error)
        return "not checked: model.generate itself fails (" + coverage._short(error) + ")"
    stats = sk.SpeculationStats()
    try:
        got = sk.generate(target, ids, assistant_early_exit=1, num_speculative_tokens=coverage.GAMMA,
                          speculation_stats=stats, **common, **extra)
    except (ValueError, TypeError) as error:
        return "refused: " + coverage._short(error)
    except Exception as error:  # noqa: BLE001
        coverage._reraise_timeout(error)
        return "ERROR: " + coverage._short(error)
    if got.shape != expected.shape or not torch.equal(got, expected):
        return "DIFFERENT"
    return f"exact (acceptance {stats.acceptance_rate:.2f})"


def sweep(types, out, timeout: int) -> None:
    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(coverage.Timeout()))
    for model_type, kind in types:
        row = {"model_type": model_type, "kind": kind}
        signal.alarm(timeout)
        try:
            target, _ = coverage._models(model_type, kind)
            row["architecture"] = type(target).__name__
            for name, batch, extra in CELLS:
                row[name] = _cell(target, batch, extra)
        except coverage.Timeout:
            row.update({name: f"not checked: over {timeout} s" for name, _, _ in CELLS if name not in row})
        except Exception as error:  # noqa: BLE001
            row.update({name: "not checked: building the tiny model fails (" + coverage._short(error) + ")"
                        for name, _, _ in CELLS if name not in row})
        finally:
            signal.alarm(0)
        print(json.dumps(row), file=out, flush=True)


def summary(rows) -> str:
    counts = collections.Counter()
    defects = []
    for row in rows:
        for name, _, _ in CELLS:
            cell = row.get(name, "")
            status = "not checked" if cell.startswith("not checked") else cell.split(" ")[0].rstrip(":")
            counts[status] += 1
            if status in ("DIFFERENT", "ERROR"):
                defects.append(f"{row['model_type']} {name}: {cell}")
    lines = [f"{len(rows)} architectures, {sum(counts.values())} cells: "
             + ", ".join(f"{n} {s}" for s, n in counts.most_common())]
    return "\n".join(lines + defects)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per architecture")
    parser.add_argument("--summary", type=Path, help="print the counts (and any defect) of a sweep's JSONL")
    args = parser.parse_args(argv)
    if args.summary:
        rows = [json.loads(line) for line in args.summary.read_text().splitlines() if line.strip()]
        print(summary(rows))
        return 0 if "DIFFERENT" not in summary(rows) and "ERROR" not in summary(rows) else 1
    types = coverage.all_types()
    if args.only:
        wanted = set(args.only.split(","))
        types = [(t, k) for t, k in types if t in wanted]
    with (open(args.out, "w") if args.out else sys.stdout) as out:
        sweep(types, out, args.timeout)
    if args.out:
        rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
        print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
