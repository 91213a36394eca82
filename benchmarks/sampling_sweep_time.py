"""CPU seconds of the sampling differential sweep's cases (``tests/helpers/sampling_differential.py``: random
processor, warper and EOS settings, batches of ~1000 rows), with the draft's bans (``draft_processors.py``) on and
off, alternated: a cost check of the processors at large batch.

    OMP_NUM_THREADS=1 python benchmarks/sampling_sweep_time.py --family llama --cases 6
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", help="llama, t5 or bart")
    parser.add_argument("--cases", type=int, default=6, help="seeds 0..cases-1")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    import torch
    from helpers import sampling_differential as sweep

    from speculative_kernels.generation import draft_processors

    torch.set_num_threads(1)
    target, draft = sweep.models(args.family)
    start = draft_processors.DraftProcessors.start
    for _ in range(args.rounds):
        for off in (False, True):
            draft_processors.DraftProcessors.start = classmethod(lambda cls, *a: None) if off else start
            began = time.process_time()
            for seed in range(args.cases):
                sweep.check_case(sweep.random_case(seed, args.family), target, draft)
            print(f"draft's bans {'off' if off else 'on '}: {time.process_time() - began:.1f} s")
    draft_processors.DraftProcessors.start = start
    return 0


if __name__ == "__main__":
    sys.exit(main())
