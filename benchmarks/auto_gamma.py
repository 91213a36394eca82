"""num_speculative_tokens="auto" on the demo pair (CPU): tokens per second and the gamma each prompt ended at, for the
n-gram drafter, the draft model and a draft that is never right (the draft model's shape with random weights: what
"auto" pauses for), beside ``model.generate`` and fixed gammas of the same drafters.

    python benchmarks/auto_gamma.py                       # this checkout
    python benchmarks/auto_gamma.py --package /tmp/old    # another tree of the package (a paired before/after:
                                                          # alternate the two in one shell loop)
    python benchmarks/auto_gamma.py --no-pause-rows       # also "auto" with pausing off (PAUSE_BELOW = 0), in the
                                                          # same run: the ratio pause / no pause is like for like

Every configuration runs each prompt in turn (configurations interleaved per prompt, so that load changes hit
them alike); times are CPU seconds of this process (``time.process_time``), which a shared machine's load does not
inflate as much as wall time.
"""

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the tree to import speculative_kernels from")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gammas", default="auto", help="comma-separated: auto and/or ints")
    p.add_argument("--drafters", default="ngram,model,random", help="comma-separated: ngram, model, random")
    p.add_argument("--no-pause-rows", action="store_true", help="add 'auto' rows with pausing off (the tree must "
                   "have generation/gamma.py's PAUSE_BELOW)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.package))
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    import speculative_kernels as sk
    from speculative_kernels.demo import BUILTIN_PROMPTS
    from speculative_kernels.demo_pair import load_demo_pair
    from speculative_kernels.generation import gamma as gamma_mod

    torch.set_num_threads(1)
    target, draft, tokenizer = load_demo_pair()
    torch.manual_seed(0)
    random_draft = AutoModelForCausalLM.from_config(draft.config).eval()  # the draft's shape, so the same c
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in BUILTIN_PROMPTS[: args.prompts]]
    makers = {"ngram": lambda: dict(drafter=sk.NGramDrafter.for_model(target)),
              "model": lambda: dict(draft_model=draft), "random": lambda: dict(draft_model=random_draft)}
    drafters = {name: makers[name] for name in args.drafters.split(",")}
    gammas = [g if g == "auto" else int(g) for g in args.gammas.split(",")]

    @contextlib.contextmanager
    def no_pause():
        saved, gamma_mod.PAUSE_BELOW = gamma_mod.PAUSE_BELOW, 0.0
        try:
            yield
        finally:
            gamma_mod.PAUSE_BELOW = saved

    configs = [("model.generate", None, None, contextlib.nullcontext)]
    for name, make in drafters.items():
        for gamma in gammas:
            configs.append((name, gamma, make, contextlib.nullcontext))
            if gamma == "auto" and args.no_pause_rows:
                configs.append((name, "auto, no pause", make, no_pause))
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None)
    for ids in prompts[:2]:  # warm-up: first-use costs of each width stay out of the figures
        target.generate(ids, **dict(kwargs, max_new_tokens=32))
        for make in drafters.values():
            sk.generate(target, ids, num_speculative_tokens="auto", **dict(kwargs, max_new_tokens=64), **make())
    print(f"package {sk.__file__}; torch {torch.__version__}; {len(prompts)} prompts x {args.max_new_tokens} new "
          "tokens, greedy, EOS off, CPU seconds of this process", flush=True)
    totals = {i: [0.0, 0, [], None] for i in range(len(configs))}  # seconds, tokens, gamma at the end, same output
    for ids in prompts:
        expected = None
        for i, (name, gamma, make, context) in enumerate(configs):
            with context(), torch.inference_mode():
                start = time.process_time()
                if make is None:
                    out = target.generate(ids, **kwargs)
                else:
                    stats = sk.SpeculationStats()
                    out = sk.generate(target, ids, num_speculative_tokens=6 if gamma is None else
                                      ("auto" if str(gamma).startswith("auto") else gamma),
                                      speculation_stats=stats, **kwargs, **make())
                seconds = time.process_time() - start
            expected = out if make is None else expected
            row = totals[i]
            row[0] += seconds
            row[1] += out.shape[1] - ids.shape[1]
            if make is not None:
                row[2].append(stats.num_speculative_tokens)
            row[3] = (row[3] is not False) and bool(torch.equal(out, expected))
    base = totals[0][1] / totals[0][0]
    print("| drafter | γ | tok/s | × model.generate | γ at the end, per prompt | same output |")
    print("|---|---|---:|---:|---|---|")
    for i, (name, gamma, _, _) in enumerate(configs):
        seconds, tokens, ended, same = totals[i]
        print(f"| {name} | {'-' if gamma is None else gamma} | {tokens / seconds:.1f} | {tokens / seconds / base:.2f} "
              f"| {ended or '-'} | {'yes' if same else 'NO'} |", flush=True)
    return 0 if all(row[3] for row in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
