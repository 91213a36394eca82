"""num_speculative_tokens="auto" on the demo pair (CPU): tokens per second and the gamma each prompt ended at, for the
n-gram drafter and the draft model, beside fixed gammas of the same drafters.

    python benchmarks/auto_gamma.py                       # this checkout
    python benchmarks/auto_gamma.py --package /tmp/old    # another tree of the package (a paired before/after:
                                                          # alternate the two in one shell loop)
"""

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the tree to import speculative_kernels from")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gammas", default="auto", help="comma-separated: auto and/or ints")
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.package))
    import torch

    import speculative_kernels as sk
    from speculative_kernels.demo import BUILTIN_PROMPTS
    from speculative_kernels.demo_pair import load_demo_pair

    torch.set_num_threads(1)
    target, draft, tokenizer = load_demo_pair()
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in BUILTIN_PROMPTS[: args.prompts]]
    drafters = {"ngram": lambda: dict(drafter=sk.NGramDrafter.for_model(target)), "model": lambda: dict(draft_model=draft)}
    gammas = [g if g == "auto" else int(g) for g in args.gammas.split(",")]
    for ids in prompts[:2]:  # warm-up: first-use costs of each width stay out of the figures
        for make in drafters.values():
            sk.generate(target, ids, num_speculative_tokens="auto", max_new_tokens=64, do_sample=False, **make())
    print(f"package {sk.__file__}")
    for name, make in drafters.items():
        for gamma in gammas:
            seconds = tokens = 0
            ended = []
            for ids in prompts:
                stats = sk.SpeculationStats()
                sk.generate(target, ids, num_speculative_tokens=gamma, max_new_tokens=args.max_new_tokens,
                            do_sample=False, speculation_stats=stats, **make())
                seconds += stats.total_time_s
                tokens += stats.new_tokens
                ended.append(stats.num_speculative_tokens)
            print(f"{name:6s} gamma={gamma!s:5s} {tokens / seconds:7.1f} tok/s  gamma at the end {ended}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
