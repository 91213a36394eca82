"""The ``torch._dynamo.config`` settings the captured steps (``compile=True``) run under, by the name the installed
torch gives each one, and what is done where a torch has none of an option's names.

Names changed across the supported torch versions: torch 2.6 has ``cache_size_limit`` and ``fail_on_cache_limit_hit``;
2.7 renamed them ``recompile_limit`` and ``fail_on_recompile_limit_hit`` and kept the old names as aliases (so did
2.8 to 2.15). ``skip_nnmodule_hook_guards`` has one name in all of them (each one's torch/_dynamo/config.py read:
2.6.0 to 2.12.0 from their wheels, 2.13.0, 2.14.1 and 2.15.0 installed).

An option the tokens depend on is required: without it ``compile=True`` is refused with a ValueError naming it and
the torch version, before anything is compiled. An option that only keeps speed or a clear error is applied where
present, and its absence is logged once with what it changes, never skipped in silence.
"""

import dataclasses
import functools
import logging

import torch

logger = logging.getLogger("speculative_kernels")


@dataclasses.dataclass(frozen=True)
class DynamoOption:
    """One dynamo setting: ``names`` (newest first: the first the installed torch has is set), its ``value``, and
    ``without``: what happens where a torch has none of the names. ``exact``: the tokens depend on it."""

    names: tuple[str, ...]
    value: object
    exact: bool
    without: str


# Every captured step of one runner class shares its step's code object, and dynamo keeps one cache per code object:
# each model, width and batch size is an entry.
# dynamo skips its guards on module hooks by default: a forward hook registered after a step was captured would be
# left out of the captured steps, which later calls reuse (tokens of neither model.generate with the hook nor without
# it, measured: tests/generation/test_compile.py::test_a_hook_registered_after_capture_is_applied)
HOOK_GUARDS = DynamoOption(
    ("skip_nnmodule_hook_guards",), False, exact=True,
    without="captured steps would not guard on the models' forward hooks, so a hook registered or removed after a "
            "step was captured would be left out of (or kept in) the steps later calls reuse, silently")
# the per-code limit (dynamo's default 8) raised, so that several models, batch sizes and cache buckets fit
RECOMPILE_LIMIT = DynamoOption(
    ("recompile_limit", "cache_size_limit"), 64, exact=False,
    without="dynamo's own limit of compiled shapes per step applies (8 by default) instead of 64")
# past the limit dynamo runs the step eagerly from then on (for that code object, until torch._dynamo.reset(), seen
# on torch 2.13): the same computation, so the eager static path's tokens (checked:
# tests/generation/test_dynamo_options.py), only slower. Failing makes it visible (captured.call_captured's
# RuntimeError says what to do).
FAIL_PAST_LIMIT = DynamoOption(
    ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True, exact=False,
    without="past dynamo's limit of compiled shapes the captured steps run eagerly (the same tokens, slower) instead "
            "of stopping with a RuntimeError")
OPTIONS = (HOOK_GUARDS, RECOMPILE_LIMIT, FAIL_PAST_LIMIT)


def _present_name(option: DynamoOption, config) -> str | None:
    return next((name for name in option.names if hasattr(config, name)), None)


def current_value(option: DynamoOption, config=None) -> object:
    """The installed torch's value of ``option`` now (None where it has none of its names)."""
    config = torch._dynamo.config if config is None else config
    name = _present_name(option, config)
    return None if name is None else getattr(config, name)


def check_exact_options(config=None) -> None:
    """ValueError (naming ``compile``, the option and the torch version) where the installed torch lacks an option the
    captured steps' tokens depend on; called where ``compile=`` is read, before anything is compiled."""
    config = torch._dynamo.config if config is None else config
    for option in OPTIONS:
        if option.exact and _present_name(option, config) is None:
            raise ValueError(
                f"compile=True needs torch._dynamo.config.{' / '.join(option.names)}, which torch "
                f"{torch.__version__} does not have: {option.without}. Decode without compile= (the eager static "
                "cache gives the same tokens), or use a torch that has it (2.6 to 2.15 do)")


@functools.lru_cache(maxsize=None)  # once per process and option: the reason is logged, not repeated at every step
def _log_missing(option: DynamoOption, version: str) -> None:
    logger.warning("speculative_kernels: torch %s has no torch._dynamo.config.%s: %s", version,
                   " / ".join(option.names), option.without)


def dynamo_settings(config=None) -> dict[str, object]:
    """``{config name: value}`` to patch ``torch._dynamo.config`` with around the captured steps, by the installed
    torch's names. ValueError where an option the tokens depend on is missing (``check_exact_options``); a missing
    performance option is logged (once) and left out."""
    config = torch._dynamo.config if config is None else config
    check_exact_options(config)
    settings = {}
    for option in OPTIONS:
        name = _present_name(option, config)
        if name is None:
            _log_missing(option, torch.__version__)
        else:
            settings[name] = option.value
    return settings
