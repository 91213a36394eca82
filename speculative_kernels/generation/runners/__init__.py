"""Runners drive one model each over its KV cache for the loop: forward, roll back, select rows (``protocol.py``).

Decoder-only and encoder-decoder models, on HF's dynamic cache or a preallocated one (whose steps can be captured);
``factory.py`` sizes and builds them, ``capabilities.py`` (one level up) says which models they can drive.
"""

from .captured import capture_steps
from .factory import RunnerPlan, make_runner, plan_runners
from .protocol import CapturableRunner, Runner

__all__ = ["CapturableRunner", "Runner", "RunnerPlan", "capture_steps", "make_runner", "plan_runners"]
