"""Wall-clock timing of a call with the device synchronised around it (the CLI, the demo and the benchmarks)."""

import statistics
import time


def synchronize(device) -> None:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(fn, device, clock=time.perf_counter):
    """(result, seconds) of fn() with the device (a str or torch.device) synchronised around it, on ``clock``
    (the wall clock; the benchmarks' ``--clock process`` passes time.process_time: this process's CPU time, the
    figure that holds on a shared CPU, blind to a GPU's work)."""
    synchronize(device)
    start = clock()
    result = fn()
    synchronize(device)
    return result, clock() - start


def median_run(tokens, seconds) -> int:
    """Index of the run whose tokens/s is the median of the runs' (of the middle two, the slower): its tokens and
    its seconds give that rate. Where runs differ in length (sampling: each stops at its own EOS), one run's tokens
    over the median of the times would mix runs. tokens, seconds: per run."""
    if not tokens or len(tokens) != len(seconds):
        raise ValueError(f"need as many token counts as times, at least one: {len(tokens)} and {len(seconds)}")
    rates = [t / s if s > 0 else float("inf") for t, s in zip(tokens, seconds)]
    order = sorted(range(len(rates)), key=lambda i: rates[i])
    return order[(len(order) - 1) // 2]


def timed_runs(fn, device, repeats: int, clock=time.perf_counter) -> list:
    """[(result, seconds)] of ``repeats`` timed calls of fn() on ``clock`` (``timed_generate``), after one untimed
    warm-up call."""
    fn()
    return [timed_generate(fn, device, clock) for _ in range(repeats)]


def timed_median(fn, device, repeats: int):
    """(last result, median seconds over ``repeats`` timed calls) of fn(), after one untimed warm-up call."""
    fn()
    times, result = [], None
    for _ in range(repeats):
        result, seconds = timed_generate(fn, device)
        times.append(seconds)
    return result, statistics.median(times)
