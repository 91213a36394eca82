"""The knobs of ``generate`` beyond HF's: batched decoding (``BatchingOptions``) and compiled steps
(``CompileOptions``); the static caches of continuous batching (``StaticRows``)."""

import dataclasses
import math

import torch

from .dynamo_options import check_exact_options


@dataclasses.dataclass(frozen=True)
class BatchingOptions:
    """Knobs of batched decoding (batch > 1); the defaults suit most workloads (``docs/batching.md``).

    compaction_threshold: compact when that frees more than this fraction of the used slots, the width past the
        row with the most real slots (0 < t <= 1).
    drop_finished_fraction: drop finished rows from the batch once at least this fraction of it has finished
        (0 < f <= 1); None never drops.
    compaction_backend: backend of ``ops.compact_kv`` ("auto", "torch", "triton", "cuda").
    static_slack: extra static-cache slots, as a fraction of the minimum capacity, that let holes accumulate between
        compactions (None: compaction_threshold). Memory grows by this fraction; compactions get rarer.
    """

    compaction_threshold: float = 0.25
    drop_finished_fraction: float | None = 0.25
    compaction_backend: str = "auto"
    static_slack: float | None = None

    def __post_init__(self):
        if not 0.0 < self.compaction_threshold <= 1.0:
            raise ValueError(f"compaction_threshold must be in (0, 1], got {self.compaction_threshold}")
        if self.drop_finished_fraction is not None and not 0.0 < self.drop_finished_fraction <= 1.0:
            raise ValueError(f"drop_finished_fraction must be in (0, 1] or None, got {self.drop_finished_fraction}")
        if self.static_slack is not None and not 0.0 <= self.static_slack <= 4.0:
            raise ValueError(f"static_slack must be in [0, 4] or None, got {self.static_slack}")

    @property
    def slack(self) -> float:
        return self.compaction_threshold if self.static_slack is None else self.static_slack

    def rows_to_drop(self, num_finished: int, batch: int) -> bool:
        """Whether to drop ``num_finished`` finished rows out of ``batch`` now (some row must stay unfinished)."""
        if self.drop_finished_fraction is None or num_finished == 0 or num_finished >= batch:
            return False
        return num_finished >= max(1, math.ceil(self.drop_finished_fraction * batch))


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How ``generate(..., compile=...)`` captures the draft and verification steps.

    mode: ``torch.compile`` mode; None picks "reduce-overhead" (CUDA graphs) on CUDA and "default" elsewhere.
    backend: ``torch.compile`` backend ("inductor"; "aot_eager" traces without code generation, for debugging).
    dynamic: ``torch.compile``'s; None picks False (one graph per shape) for ``generate``'s fixed batch and None
    (dynamo's automatic dynamic shapes) for a continuous batch, whose size changes as requests join and leave.
    """

    mode: str | None = None
    backend: str = "inductor"
    dynamic: bool | None = None

    def __post_init__(self):
        if self.mode is not None and self.backend != "inductor":  # (torch.compile ignores it there, with a warning)
            raise ValueError(f"CompileOptions.mode={self.mode!r} applies to the inductor backend only; "
                             f"backend={self.backend!r} has no modes")

    def torch_compile_kwargs(self, device: torch.device, batch_changes: bool = False) -> dict:
        """The ``torch.compile`` keyword arguments on ``device``; batch_changes: the batch size changes between
        calls (continuous batching)."""
        mode = self.mode or ("reduce-overhead" if device.type == "cuda" else "default")
        dynamic = self.dynamic if self.dynamic is not None else (None if batch_changes else False)
        kwargs = {"backend": self.backend, "dynamic": dynamic}
        if self.backend == "inductor":
            kwargs["mode"] = mode
        return kwargs

    @staticmethod
    def from_argument(compile) -> "CompileOptions | None":
        """``generate``'s ``compile`` argument (False, True or a CompileOptions) as CompileOptions or None."""
        if compile is None or compile is False:
            return None
        if compile is not True and not isinstance(compile, CompileOptions):
            raise TypeError(f"compile must be a bool or a CompileOptions, got {type(compile).__name__}")
        check_exact_options()  # (before anything is allocated or compiled)
        return CompileOptions() if compile is True else compile


@dataclasses.dataclass(frozen=True)
class StaticRows:
    """Static caches allocated for more rows than a loop starts with, so that rows can join it in place
    (``SpeculativeDecoder(cache_implementation="static", max_context=...)``): ``rows`` rows of
    ``sizing.static_capacity(max_context, 0, gamma, rows, slack)`` slots each, of which the batch uses the first B.
    rows: the most rows the batch can hold (>= 1); max_context: the most tokens (prompt plus new) of any row."""

    rows: int
    max_context: int

    def __post_init__(self):
        for name in ("rows", "max_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def gamma(self, gamma: int) -> int:
        """The gamma the caches are sized for: ``gamma``, capped at what a row can draft in one iteration (at most its
        own tokens left less one, and no row has more than max_context - 1 new tokens)."""
        return min(gamma, max(1, self.max_context - 2))
