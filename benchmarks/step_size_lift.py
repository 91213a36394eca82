"""The host time of the step-size lift (``generation/step_size.py``: one enter and exit of ``unbounded_step_size``
around every forward after the prompt of a bounded Zamba2 / Nemotron-H target) against the attribute it replaced
(each mixer's ``time_step_limit`` set for the forward and restored, which other threads saw), and of the mixers'
reads of their limit. Mixers: copies of a tiny Zamba2's bounded mixer (the lift's cost does not depend on its size);
81 is Zamba2-7B-Instruct's num_hidden_layers, each layer with a Mamba2 mixer in transformers' Zamba2.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/step_size_lift.py --mixers 81
"""

import argparse
import contextlib
import copy
import sys
import timeit
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "generation")]

from speculative_kernels.generation import step_size  # noqa: E402
from test_recurrent_step_size import zamba2  # noqa: E402


@contextlib.contextmanager
def attribute_lift(mixers):
    """The lift before the per-thread one (2026-11-28, 11f4a07): the shared attribute, set and restored."""
    saved = [module.time_step_limit for module in mixers]
    try:
        for module in mixers:
            module.time_step_limit = step_size.UNBOUNDED
        yield
    finally:
        for module, limit in zip(mixers, saved):
            module.time_step_limit = limit


def best_us(function, number: int = 2000, repeat: int = 7) -> float:
    return min(timeit.repeat(function, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixers", type=int, default=81)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mixers = [copy.deepcopy(step_size.bounded_mixers(zamba2(seed=0))[0]) for _ in range(args.mixers)]

    def lift_with(lift):
        def once():
            with lift(mixers):
                pass
        return once

    def reads():
        for mixer in mixers:
            mixer.time_step_limit

    rows = [("attribute lift (before): enter + exit", best_us(lift_with(attribute_lift))),
            ("per-thread lift: enter + exit", best_us(lift_with(step_size.unbounded_step_size))),
            ("reads of time_step_limit, no lift", best_us(reads))]
    with step_size.unbounded_step_size(mixers):
        rows.append(("reads of time_step_limit, lifted (the property)", best_us(reads)))
    print(f"| {args.mixers} mixers | µs (best of 7 x 2000) |\n|---|---:|")
    for name, micros in rows:
        print(f"| {name} | {micros:.1f} |")


if __name__ == "__main__":
    main()
