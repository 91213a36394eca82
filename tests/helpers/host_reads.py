"""Counting device-to-host reads: the decode loop reads the device at most once per iteration."""

from torch.overrides import TorchFunctionMode

HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
              "any", "all"}


class CountHostReads(TorchFunctionMode):
    """Counts calls that move tensor values to the host (``any``/``all`` count only when their result is read)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS - {"any", "all"}:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def step_reading_once(session) -> int:
    """Step a ``DecodeSession`` to the end, asserting that every iteration makes exactly one host read (the
    ``tolist`` of its flags and tokens). Returns the number of iterations."""
    steps = 0
    while not session.finished:
        with CountHostReads() as counter:
            session.step()
        assert counter.reads == ["tolist"], f"iteration {steps}: host reads {counter.reads}"
        steps += 1
    return steps


def count_reads_per_loop_step(monkeypatch) -> list:
    """Patch ``SpeculativeLoop.step`` to record each call's host reads; returns the list they are appended to
    (one list of read names per step)."""
    from speculative_kernels.generation.loop import SpeculativeLoop

    reads = []
    step = SpeculativeLoop.step

    def counted(loop):
        with CountHostReads() as counter:
            running = step(loop)
        reads.append(counter.reads)
        return running

    monkeypatch.setattr(SpeculativeLoop, "step", counted)
    return reads
