"""The SSM step-size bound of transformers' Mamba2 mixers: where it applies in ``model.generate``, and how the
speculative forwards apply it in the same places.

transformers' Mamba2 mixers (Mamba2, Bamba, Granite 4 hybrids, Falcon-H1, Zamba2, Nemotron-H; 5.17 to 5.24) clamp
dt = softplus(dt + dt_bias) to ``time_step_limit`` in their chunked scan, the path of a forward over several tokens,
and not in their one-token step (``mamba2_selective_state_update`` takes no limit, nor does mamba_ssm's kernel).
model.generate runs the whole prompt through the scan (clamped) and every later token through the step (unclamped).
So a model whose limit is bounded (Zamba2's and Nemotron-H's: (time_step_min, inf), 0.001 by default) is exact when

* the target's prompt forwards are model.generate's own (the whole prompt, clamped; the first token is drawn from
  them: ``SpeculativeLoop``'s ``first_token_from_prompt``, as the last prompt token is clamped there), and
* every forward after the prompt (verifications, re-runs of kept tokens) runs its scan with the limit lifted to
  (0, inf) (``unbounded_step_size``), which then continues the state as the steps do: measured on tiny Zamba2 and
  Nemotron-H models whose dt falls under the limit (up to half the heads), 3.8e-6 of the logits' scale against
  model.generate's steps, 2.2e-2 with the limit kept, 1.2e-2 with the last prompt token in a lifted scan
  (transformers 5.17 and 5.24, torch path).

Every mixer reads ``self.time_step_limit`` when it runs (it passes ``dt_limit=self.time_step_limit`` to the scan,
in every transformers from 5.17 to 5.24), so the limit is lifted by setting that attribute for one forward and
restoring it afterwards, whatever the forward raises (``unread_limit_classes`` finds a mixer that does not).
The attribute is the model's own: a forward of the same model run meanwhile from another thread would see it lifted.
"""

import contextlib
import functools
import inspect

import torch

UNBOUNDED = (0.0, float("inf"))
# How the mixers pass the limit to their scan, read at every forward (transformers 5.17-5.24)
_READS_LIMIT = "dt_limit=self.time_step_limit"


def _bounds(module) -> tuple[float, float] | None:
    limit = getattr(module, "time_step_limit", None)
    if not isinstance(limit, (tuple, list)) or len(limit) != 2:
        return None
    low, high = (float(bound) for bound in limit)
    return (low, high) if low > 0.0 or high != float("inf") else None


def bounded_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` whose ``time_step_limit`` is a pair that clamps something: a lower bound above 0 or
    a finite upper one (softplus gives dt > 0, so (0, inf) clamps nothing), in ``model.modules()`` order."""
    return [module for module in model.modules() if _bounds(module) is not None]


def bounds_shown(mixers: list[torch.nn.Module]) -> str:
    """The distinct limits of ``mixers``, as '(0.001, inf), ...' for messages."""
    return ", ".join(f"({low:g}, {high:g})" for low, high in sorted({_bounds(module) for module in mixers}))


def unread_limit_classes(mixers: list[torch.nn.Module]) -> list[str]:
    """The classes among ``mixers`` whose forward's class (the first in the MRO defining ``forward``) does not pass
    ``dt_limit=self.time_step_limit`` to its scan: a mixer that reads its limit elsewhere would not see
    ``unbounded_step_size``'s lift (none in transformers 5.17-5.24)."""
    return sorted({type(module).__name__ for module in mixers if not _reads_limit(type(module))})


@functools.lru_cache(maxsize=None)  # (once per class: every layer's mixer is one, and each call checks the model)
def _reads_limit(klass: type) -> bool:
    owner = next((base for base in klass.__mro__ if "forward" in vars(base)), klass)
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):  # (a class defined where its source cannot be read)
        source = ""
    return _READS_LIMIT in source


@contextlib.contextmanager
def unbounded_step_size(mixers: list[torch.nn.Module]):
    """Within the block, every module of ``mixers`` has time_step_limit (0, inf); afterwards, whatever the block
    raised, each has its own object back."""
    saved = [module.time_step_limit for module in mixers]
    try:
        for module in mixers:
            module.time_step_limit = UNBOUNDED
        yield
    finally:
        for module, limit in zip(mixers, saved):
            module.time_step_limit = limit
