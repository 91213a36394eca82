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


class CudaSyncSites:
    """Under CUDA's sync debug mode ("warn"), records each synchronising call with the innermost frames of this
    package that led to it (``file:line function``), so a failing count names where the syncs come from.

        with CudaSyncSites() as syncs:
            ...
        syncs.sites  # one tuple of frames per synchronising call
    """

    def __init__(self, package: str = "speculative_kernels", frames: int = 3):
        self.package, self.frames, self.sites = package, frames, []

    def __enter__(self):
        import warnings

        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import torch

        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        return False

    def _record(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        if "called a synchronizing" not in str(message):
            return  # torch's one-time note that the mode "does not yet detect all synchronizing operations"
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if f"/{self.package}/" in f.filename.replace("\\", "/")]
        chosen = ours[-self.frames:] + ([stack[-1]] if stack and stack[-1] not in ours else [])
        self.sites.append(tuple(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in chosen))

    def summary(self) -> list[str]:
        """Distinct sites, most frequent first, each with its count."""
        from collections import Counter

        return [f"{n}x {' <- '.join(reversed(site))}" for site, n in Counter(self.sites).most_common()]
