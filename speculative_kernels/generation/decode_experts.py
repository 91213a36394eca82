"""The experts implementation a mixture-of-experts model decodes with, as ``model.generate`` switches it.

transformers' ``generate`` runs every forward after the prefill inside the model's ``_optimize_model_for_decode``
(5.17 and later): on a GPU, an MoE model whose experts run as ``grouped_mm`` decodes with ``batched_mm`` (faster on
few tokens; the prefill keeps ``grouped_mm``), and the model's setting is restored afterwards. Our loop does the
same, with transformers' own switch, so the installed version's rule applies: the verification and draft forwards run
inside it, the prefills outside. On the CPU, and for a dense model, the switch changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence


class DecodeExperts:
    """transformers' decode-time switch for ``models`` (target, and draft if any), entered and left explicitly.

    ``enter()`` and ``exit()`` are idempotent; a model whose transformers has no such switch is left as it is.
    """

    def __init__(self, models: Sequence):
        self._switches = [m._optimize_model_for_decode for m in models
                          if callable(getattr(m, "_optimize_model_for_decode", None))]
        self._entered: contextlib.ExitStack | None = None

    @property
    def active(self) -> bool:
        """Whether the models are in their decode-time setting now."""
        return self._entered is not None

    def enter(self) -> None:
        """Switch the models to their decode-time experts implementation (nothing if already switched)."""
        if self._entered is not None or not self._switches:
            return
        stack = contextlib.ExitStack()
        try:
            for switch in self._switches:
                stack.enter_context(switch())
        except BaseException:
            stack.close()
            raise
        self._entered = stack

    def exit(self) -> None:
        """Restore the models' own setting (nothing if not switched)."""
        entered, self._entered = self._entered, None
        if entered is not None:
            entered.close()
