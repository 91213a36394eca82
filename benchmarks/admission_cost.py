"""Admission cost of continuous batching: how much longer a ``SpeculativeDecoder.step()`` that admits one request
takes than a step that admits none, as the running requests' contexts grow.

    python benchmarks/admission_cost.py --target DIR --draft DIR2 [--running 8] [--contexts 64 512]

``--running`` greedy requests with random prompts of each context length run (400 new tokens allowed, so none
finishes); then, ``--repeats`` times: one plain step (timed), a step in which a new 20-token request with
``max_new_tokens=2`` joins (timed), and one untimed step in which it finishes. Reported: the medians, in ms, and
their difference. Admission that re-prefilled the running rows grows with their context; one that prefills the
joining rows alone does not. Since a33c610 an admitting step runs only the joining request's prefill and first
iteration (greedy: its first token from the prefill) and the merge, not an iteration of the running rows, so the
admitting step is itself the admission's cost (the difference may be negative). ``--cache-implementation static``:
continuous batching on the static cache (``max_context`` = the longest context + 400). Output: one JSON object.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import speculative_kernels as sk  # noqa: E402


def measure(decoder, context: int, running: int, repeats: int, vocab: int, generator) -> dict:
    for _ in range(running):
        decoder.add_request(torch.randint(3, vocab, (context,), generator=generator), max_new_tokens=400,
                            do_sample=False)
    for _ in range(3):  # admitted, then warm
        decoder.step()
    plain, admitting = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        decoder.step()
        plain.append(time.perf_counter() - start)
        decoder.add_request(torch.randint(3, vocab, (20,), generator=generator), max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        decoder.step()
        admitting.append(time.perf_counter() - start)
        decoder.step()
    for request_id in decoder.running + decoder.queued:
        decoder.cancel(request_id)
    p, a = round(statistics.median(plain) * 1e3, 1), round(statistics.median(admitting) * 1e3, 1)
    return {"plain_step_ms": p, "admitting_step_ms": a, "admission_ms": round(a - p, 1)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--running", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--cache-implementation", choices=["dynamic", "static"], default="dynamic")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval().to(device)
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).eval().to(device)
    static = {} if args.cache_implementation == "dynamic" else dict(cache_implementation="static",
                                                                    max_context=max(args.contexts) + 400)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=args.gamma, max_batch_size=args.running + 1,
                                    **static)
    generator = torch.Generator().manual_seed(0)
    results = {"device": str(device), "running": args.running, "gamma": args.gamma,
               "cache_implementation": args.cache_implementation, "contexts": {}}
    for context in args.contexts:
        results["contexts"][context] = measure(decoder, context, args.running, args.repeats,
                                               target.config.vocab_size, generator)
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
