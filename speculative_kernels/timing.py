"""Wall-clock timing of a call with the device synchronised around it (the CLI, the demo and the benchmarks)."""

import statistics
import time


def synchronize(device) -> None:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(fn, device):
    """(result, seconds) of fn() with the device (a str or torch.device) synchronised around it."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def timed_median(fn, device, repeats: int):
    """(last result, median seconds over ``repeats`` timed calls) of fn(), after one untimed warm-up call."""
    fn()
    times, result = [], None
    for _ in range(repeats):
        result, seconds = timed_generate(fn, device)
        times.append(seconds)
    return result, statistics.median(times)
