"""How often greedy output differs from plain ``model.generate`` in half precision, ours and HF's own other paths.

    python benchmarks/half_precision.py                         # the demo pair on CPU: float32, bfloat16, float16
    python benchmarks/half_precision.py --device cuda --dtypes bfloat16,float16
    python benchmarks/half_precision.py --quick                 # 2 prompts, 8 tokens (a smoke test)

Prompts: the first two lines of the first --prompts functions (``def`` lines) of a fixed list of standard-library
modules (the demo pair was trained on the standard library). For each dtype, each path runs every prompt greedily
for --max-new-tokens tokens (EOS off) and is compared with plain ``model.generate`` on the same prompt alone:

* ours (demo draft, gamma --gamma) and ours with prompt lookup (k 3);
* HF's assisted generation with the same draft (constant schedule, same gamma);
* HF's ``generate`` with ``cache_implementation="static"``;
* HF's ``generate`` on a left-padded batch of --batch prompts (the prompt's row compared).

Reported per path: the prompts whose output differs from plain ``generate``, the mean position of the first
differing token among them, and at that position the gap between plain ``generate``'s top two logits, as a
fraction of the largest logit's magnitude (a near-tie is a gap of the order of the dtype's rounding: bfloat16's
unit roundoff is 2**-8 = 0.0039, float16's 2**-11 = 0.00049). A markdown table on stdout, JSON under --out.
"""

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import speculative_kernels as sk  # noqa: E402
from harness import environment  # noqa: E402
from speculative_kernels.demo_pair import load_demo_pair  # noqa: E402

MODULES = ("textwrap", "json.decoder", "json.encoder", "string", "shlex", "fnmatch", "glob", "posixpath",
           "calendar", "heapq", "bisect", "base64", "quopri", "csv", "difflib", "statistics", "fractions")


def stdlib_prompts(count: int) -> list[str]:
    """The first two lines of the first ``count`` top-level or method ``def`` lines of MODULES, in order."""
    prompts = []
    for name in MODULES:
        lines = inspect.getsource(importlib.import_module(name)).splitlines(keepends=True)
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                prompts.append(line + lines[i + 1])
                if len(prompts) == count:
                    return prompts
    return prompts


def _first_difference(got: torch.Tensor, reference: torch.Tensor) -> int | None:
    """Index of the first differing new token of two [L + new] sequences of one prompt (None: identical)."""
    if torch.equal(got, reference):
        return None
    width = min(len(got), len(reference))
    differ = (got[:width] != reference[:width]).nonzero()
    return int(differ[0]) if len(differ) else width


def run_dtype(target, draft, tokenizer, prompts, args, device) -> dict:
    # (the tokenizer's own pad id: 0 is the demo tokenizer's BOS, which generate would then mask as padding)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id)
    encoded = [tokenizer(p, return_tensors="pt").input_ids.to(device) for p in prompts]
    plain, plain_logits = [], []
    for ids in encoded:
        out = target.generate(ids, output_logits=True, return_dict_in_generate=True, **common)
        plain.append(out.sequences[0])
        plain_logits.append(torch.stack(out.logits, dim=1)[0].float())
    paths = {
        "ours (draft)": lambda ids: sk.generate(target, ids, draft_model=draft, num_speculative_tokens=args.gamma,
                                                **common)[0],
        "ours (prompt lookup)": lambda ids: sk.generate(target, ids, prompt_lookup_num_tokens=3, **common)[0],
        "HF assisted": lambda ids: target.generate(ids, assistant_model=draft, num_assistant_tokens=args.gamma,
                                                   num_assistant_tokens_schedule="constant", **common)[0],
        "HF static cache": lambda ids: target.generate(ids, cache_implementation="static", **common)[0],
    }
    outputs = {name: [fn(ids) for ids in encoded] for name, fn in paths.items()}
    batched = []
    tokenizer.padding_side = "left"
    for start in range(0, len(prompts), args.batch):
        batch = tokenizer(prompts[start:start + args.batch], return_tensors="pt", padding=True).to(device)
        out = target.generate(**batch, **common)
        for row in range(out.shape[0]):
            real = batch.attention_mask[row].bool()
            batched.append(torch.cat([batch.input_ids[row][real], out[row, batch.input_ids.shape[1]:]]))
    outputs[f"HF batched ({args.batch} prompts)"] = batched
    result = {}
    for name, seqs in outputs.items():
        firsts, gaps = [], []
        for p, (got, reference) in enumerate(zip(seqs, plain)):
            at = _first_difference(got, reference)
            if at is None:
                continue
            step = at - encoded[p].shape[1]
            firsts.append(step)
            logits = plain_logits[p][step]
            top = logits.topk(2).values
            gaps.append(float((top[0] - top[1]) / logits.abs().max()))
        result[name] = {"prompts": len(prompts), "differ": len(firsts),
                        "mean_first_difference": sum(firsts) / len(firsts) if firsts else None,
                        "max_relative_gap": max(gaps) if gaps else None}
    return result


def table(results: dict) -> str:
    lines = ["| dtype | path | prompts differing from plain generate | mean first differing token | "
             "largest top-2 gap there (÷ max logit) |", "|---|---|---:|---:|---:|"]
    for dtype, rows in results.items():
        for name, r in rows.items():
            first = f"{r['mean_first_difference']:.1f}" if r["mean_first_difference"] is not None else ""
            gap = f"{r['max_relative_gap']:.5f}" if r["max_relative_gap"] is not None else ""
            lines.append(f"| {dtype} | {name} | {r['differ']} / {r['prompts']} | {first} | {gap} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 8 new tokens (a smoke test)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens = 2, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = stdlib_prompts(args.prompts)
    results = {}
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            target, draft, tokenizer = load_demo_pair(dtype=getattr(torch, dtype), device=args.device)
            results[dtype] = run_dtype(target, draft, tokenizer, prompts, args, args.device)
            print(f"{dtype}: done", file=sys.stderr, flush=True)
    print(table(results))
    if args.out:
        meta = {**environment(args.device), "args": vars(args)}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
