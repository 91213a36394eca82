"""How many tokens per target forward can a drafter that copies from the context reach? Replayed, not timed.

    python benchmarks/lookup_rules.py                 # the demo target, prompt_lookup.py's tasks, 96 new tokens
    python benchmarks/lookup_rules.py --quick         # one prompt per task

Greedy output does not depend on the drafts, so a proposal rule can be scored exactly without running the loop:
generate each prompt's greedy continuation once (``model.generate``, EOS off), then replay it: at each iteration the
rule proposes from the context so far, the verified forward accepts the longest prefix that equals the continuation
and adds one token. Per rule: tokens per target forward (every forward counted, the prefill included, exact) and the
mean number of tokens each verification forward carries (its width).

Rules (K = prompt_lookup_num_tokens, n = max_matching_ngram_size):
* ``HF's rule``: the first occurrence of the longest n-gram, its continuation cut at the context's end
  (``ops.prompt_lookup(prefer_latest=False, periodic=False)``, as the library runs it);
* ``ours``: the most recent occurrence, continued periodically (the library's default, the same op); each half of
  it alone (``most recent match, cut at the end``; ``first match, periodic``), and HF's rule and ours with longer
  n-grams (n + 1, and 8: close to the longest suffix match);
* ``recursive``: one token at a time, each the follower of the latest occurrence of the longest n-gram of the
  context plus the tokens proposed so far (n up to 3);
* ``adaptive length``: ours, each row's K adapted as HF adapts an assistant's (+2 after a fully accepted
  proposal, -1 otherwise, between 1 and K);
* ``tree, M x D``: M continuations of depth D from distinct occurrences, verified together (a token tree of that
  many nodes; acceptance: the longest matching path) — the ceiling of a tree-verifying lookup;
* ``oracle``: the longest prefix (<= K) of the true continuation that occurs anywhere in the context: no rule that
  copies one span of the context can do better.

``step-equivalents`` turns widths into time with a cost model from ``verify_forward.py``: a forward of T tokens
costs 1 + slope (T - 1) single-token steps (--slope; the demo target on this CPU: T = 11 cost 1.19-1.24 steps, slope
about 0.02), so tokens per step-equivalent = new tokens / sum of forward costs. It says where a rule could land
before the loop's own per-iteration cost; only ``prompt_lookup.py`` measures time.
"""

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from harness import cpu_name  # noqa: E402
from prompt_lookup import tasks  # noqa: E402
from speculative_kernels import ops  # noqa: E402
from speculative_kernels.demo_pair import load_demo_pair  # noqa: E402


def _lookup(context: list[int], k: int, n: int, latest: bool, periodic: bool) -> list[int]:
    tokens = torch.tensor([context])
    end = torch.tensor([len(context)])
    proposal, count = ops.prompt_lookup(tokens, torch.zeros_like(end), end, num_tokens=k, max_ngram=n,
                                        prefer_latest=latest, periodic=periodic, backend="torch")
    return proposal[0, : int(count)].tolist()


def _follower(context: list[int], n_max: int) -> int | None:
    for n in range(min(n_max, len(context) - 1), 0, -1):
        suffix = context[-n:]
        for j in range(len(context) - n - 1, -1, -1):
            if context[j:j + n] == suffix:
                return context[j + n]
    return None


def _recursive(context: list[int], k: int) -> list[int]:
    extended, out = list(context), []
    for _ in range(k):
        token = _follower(extended, 3)
        if token is None:
            break
        out.append(token)
        extended.append(token)
    return out


def _tree(context: list[int], n: int, paths: int, depth: int) -> list[list[int]]:
    found, seen = [], set()
    for size in range(min(n, len(context) - 1), 0, -1):
        suffix = context[-size:]
        for j in range(len(context) - size - 1, -1, -1):
            if context[j:j + size] == suffix:
                start, period = j + size, len(context) - j - size
                path = tuple(context[start + t % period] for t in range(depth))
                if path not in seen:
                    seen.add(path)
                    found.append(list(path))
                if len(found) == paths:
                    return found
    return found


def _nodes(paths: list[list[int]]) -> int:
    return len({tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)})


def _oracle(context: list[int], continuation: list[int], k: int) -> list[int]:
    for length in range(min(k, len(continuation)), 0, -1):
        wanted = continuation[:length]
        if any(context[j:j + length] == wanted for j in range(len(context) - length + 1)):
            return wanted
    return []


def replay(prompt: list[int], continuation: list[int], propose, slope: float) -> dict:
    """propose(context, remaining continuation, state) -> list of candidate paths. Returns forwards, widths, cost."""
    context, done, forwards, width_sum, cost, state = list(prompt), 0, 1, 0, 1.0, {}
    while done < len(continuation):
        left = continuation[done:]
        paths = [p[: len(left) - 1] for p in propose(context, left, state)]
        accepted = 0
        for path in paths:
            a = 0
            while a < len(path) and path[a] == left[a]:
                a += 1
            accepted = max(accepted, a)
        state["last"] = (accepted, max((len(p) for p in paths), default=0))
        width = _nodes(paths) + 1
        context += left[: accepted + 1]
        done += accepted + 1
        forwards += 1
        width_sum += width
        cost += 1 + slope * (width - 1)
    return {"forwards": forwards, "width": width_sum, "iterations": forwards - 1, "cost": cost}


def rules(k: int, n: int) -> dict:
    def adaptive(context, left, state):
        budget = state.get("budget", k)
        if "last" in state and state["last"][1]:
            accepted, proposed = state["last"]
            budget = min(k, budget + 2) if accepted == proposed else max(1, budget - 1)
        state["budget"] = budget
        return [_lookup(context, k, n, True, True)[:budget]]

    table = {
        f"HF's rule (K={k})": lambda c, left, s: [_lookup(c, k, n, False, False)],
        f"ours (K={k})": lambda c, left, s: [_lookup(c, k, n, True, True)],
        # the two halves of ours alone, and other n-gram sizes (docs/drafting_without_a_model.md's rule table)
        f"most recent match, cut at the end (K={k})": lambda c, left, s: [_lookup(c, k, n, True, False)],
        f"first match, periodic (K={k})": lambda c, left, s: [_lookup(c, k, n, False, True)],
        f"HF's rule, n={n + 1} (K={k})": lambda c, left, s: [_lookup(c, k, n + 1, False, False)],
        f"ours, n={n + 1} (K={k})": lambda c, left, s: [_lookup(c, k, n + 1, True, True)],
        f"ours, n=8 (K={k})": lambda c, left, s: [_lookup(c, k, 8, True, True)],
        f"recursive (K={k})": lambda c, left, s: [_recursive(c, k)],
        f"ours, adaptive length (K<={k})": adaptive,
    }
    for paths, depth in ((2, 8), (4, 6), (4, 10)):
        table[f"tree, {paths} x {depth}"] = lambda c, left, s, p=paths, d=depth: _tree(c, n, p, d)
    table[f"oracle (K={k})"] = lambda c, left, s: [_oracle(c, left, k)]
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--ngram", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--slope", type=float, default=0.02, help="extra cost of each verified token, in steps")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    target, _, tokenizer = load_demo_pair()
    results = {}
    with torch.inference_mode():
        for task, prompts in tasks(tokenizer, args.quick).items():
            sums = {}
            for text in prompts:
                prompt = tokenizer(text, return_tensors="pt").input_ids
                out = target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=2, attention_mask=torch.ones_like(prompt))
                prompt_ids, continuation = prompt[0].tolist(), out[0, prompt.shape[1]:].tolist()
                for name, propose in rules(args.k, args.ngram).items():
                    r = replay(prompt_ids, continuation, propose, args.slope)
                    total = sums.setdefault(name, {"tokens": 0, "forwards": 0, "width": 0, "iterations": 0,
                                                   "cost": 0.0})
                    total["tokens"] += len(continuation)
                    for key in ("forwards", "width", "iterations", "cost"):
                        total[key] += r[key]
            results[task] = sums
    print(f"| task | rule | tok/fwd | mean verify width | tok/step-equivalent (slope {args.slope}) | × HF's rule |")
    print("|---|---|---:|---:|---:|---:|")
    for task, sums in results.items():
        hf = next(v for name, v in sums.items() if name.startswith("HF"))
        for name, v in sums.items():
            per_step = v["tokens"] / v["cost"]
            print(f"| {task} | {name} | {v['tokens'] / v['forwards']:.2f} | {v['width'] / v['iterations']:.1f} | "
                  f"{per_step:.2f} | {per_step / (hf['tokens'] / hf['cost']):.2f} |")
    if args.json:
        environment = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                       "cpu": cpu_name(), "torch": torch.__version__, "transformers": transformers.__version__,
                       "python": platform.python_version(), "command": " ".join(["python", *sys.argv])}
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "environment": environment, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
