"""Captured steps (``compile=True``): compiling a runner's step, calling the compiled step, and capturing and warming
up the steps of a request before it decodes."""

import time
from collections.abc import Callable, Sequence

import torch

from ..dynamo_options import RECOMPILE_LIMIT, current_value, dynamo_settings
from ..options import CompileOptions
from .protocol import CapturableRunner

# what dynamo raises past its recompile limit where told to fail (FailOnRecompileLimitHit in torch 2.6 to 2.15,
# FailOnCacheLimitHit in older ones)
_LIMIT_HIT = tuple(error for error in (getattr(torch._dynamo.exc, name, None)
                                       for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit"))
                   if isinstance(error, type))


def dynamo_limits():
    """Context setting the dynamo options the captured steps run under (``dynamo_options.OPTIONS``: hook guards, a
    raised recompile limit, failing past it), by the installed torch's names; ValueError where it lacks one the tokens
    depend on."""
    return torch._dynamo.config.patch(**dynamo_settings())


def mark_static(tensors: Sequence[torch.Tensor]) -> None:
    """Mark the tensors a captured step reads and writes in place (the cache, masks, pointers) as static addresses,
    so that a captured graph reads and writes them where they are at replay time instead of copying them in (an
    input written in place that is not static makes inductor skip the CUDA graph)."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


def compile_step(step: Callable, options: CompileOptions, device: torch.device,
                 static: Sequence[torch.Tensor], batch_changes: bool = False) -> Callable:
    """``torch.compile`` of ``step``; ``static``: see ``mark_static``; batch_changes: the batch size changes between
    calls (``CompileOptions.torch_compile_kwargs``)."""
    mark_static(static)
    return torch.compile(step, **options.torch_compile_kwargs(device, batch_changes))


def check_no_global_hooks() -> None:
    """ValueError while a global module forward hook is registered (``torch.nn.modules.module.
    register_module_forward_hook`` / ``_pre_hook``): dynamo does not guard those, so captured steps compiled before
    one was registered (or removed) would be reused without it (measured: a mix of hooked and unhooked steps)."""
    from torch.nn.modules import module

    if module._global_forward_hooks or module._global_forward_pre_hooks:
        raise ValueError("compile=True cannot run while a global module forward hook is registered "
                         "(register_module_forward_hook / register_module_forward_pre_hook, also active inside "
                         "tools such as FlopCounterMode): torch.compile does not guard global hooks, so captured "
                         "steps compiled without it would run without it; register the hook on the model's modules "
                         "instead (those are guarded), or decode without compile=")


def call_captured(compiled: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    """Run a compiled step on fresh copies of its inputs (one inference mode and one stride per shape for the guards)
    and return a copy of its output (a captured graph's outputs are overwritten by its next replay)."""
    torch.compiler.cudagraph_mark_step_begin()
    fresh = torch.contiguous_format
    with dynamo_limits():
        try:
            out = compiled(*(t.clone(memory_format=fresh) for t in inputs))
        except _LIMIT_HIT as error:
            raise RuntimeError(
                f"compile=True: this process has compiled the captured decoding steps for "
                f"{current_value(RECOMPILE_LIMIT)} shapes already (each model, batch size, gamma and cache size "
                "bucket is one; changing a model's forward hooks between calls recompiles them too, as does a "
                "hook whose Python state changes at every call, such as a call counter: the step traces the hook "
                "and guards on that state), dynamo's limit "
                "for them; call torch._dynamo.reset() to drop the compiled steps, or vary fewer of those between "
                "calls (a SpeculativeDecoder with a fixed max_context serves requests of any length with one set)") \
                from error
    return out.clone()


def capture_steps(steps: Sequence[tuple[CapturableRunner, Sequence[tuple[int, bool]]]], options: CompileOptions,
                  device: torch.device) -> float:
    """Capture each runner's steps at its (width, last_only) shapes, then warm every runner up (compile, record CUDA
    graphs). Returns the seconds it took (``SpeculationStats.warmup_time_s``)."""
    check_no_global_hooks()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for runner, shapes in steps:
        runner.capture(shapes, options)
    for runner, _ in steps:
        runner.warm_up()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
