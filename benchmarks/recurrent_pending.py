"""The recurrent runner's pending limit (``RecurrentRunner.defer``): target forwards, restores, re-runs and tokens
fed over a fixed greedy workload (6 prompts x a perturbed recurrent draft at gamma 3 and prompt lookup of 3, 32
tokens each) on a tiny model of ``tests/generation/test_recurrent.py``, with the limit at 0 (re-run at once),
gamma + 1 (the default), 2(gamma + 1) or none. Time it whole with ``farm-bench`` (RESULTS.md, "The recurrent
runner's pending limit").

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/recurrent_pending.py --model mamba2_ssm --defer gamma1
"""

import argparse
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "generation")]

import speculative_kernels as sk  # noqa: E402
import test_recurrent  # noqa: E402
from helpers.models import perturbed  # noqa: E402
from speculative_kernels.generation.runners.recurrent import RecurrentRunner  # noqa: E402

LIMITS = {"zero": lambda reserve: 0, "gamma1": lambda reserve: reserve, "double": lambda reserve: 2 * reserve,
          "none": lambda reserve: 10**9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mamba2_ssm", help="a factory of test_recurrent.py")
    parser.add_argument("--defer", choices=sorted(LIMITS), default="gamma1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runners, fed = [], [0]
    init, run = RecurrentRunner.__init__, RecurrentRunner._run

    def limited(runner, model, spec, device, reserve, defer=None):  # (reserve: gamma + 1)
        init(runner, model, spec, device, reserve, LIMITS[args.defer](reserve))
        runners.append(runner)

    def counted(runner, start, tokens, keep):
        if runner.model is target:
            fed[0] += tokens.shape[1]
        return run(runner, start, tokens, keep)

    RecurrentRunner.__init__, RecurrentRunner._run = limited, counted
    target = getattr(test_recurrent, args.model)()
    draft = perturbed(target, 0.3)
    totals = dict(forwards=0, restores=0, reruns=0)
    for seed in range(6):
        ids = test_recurrent._prompt(8 + seed, seed)
        for drafting in (dict(draft_model=draft, num_speculative_tokens=3), dict(prompt_lookup_num_tokens=3)):
            runners.clear()
            sk.generate(target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                        pad_token_id=0, eos_token_id=None, **drafting)
            for name in totals:
                totals[name] += getattr(runners[0], name)  # (the target's runner is built first)
    print(f"{args.model} defer={args.defer}: target forwards {totals['forwards']}, restores {totals['restores']}, "
          f"re-runs {totals['reruns']}, target tokens fed {fed[0]}")


if __name__ == "__main__":
    main()
