"""When a Python-bodied registered op may be called without torch's dispatcher: plain eager calls.

A ``torch.library.triton_op`` call in eager mode goes through C++ dispatch, a Python autograd layer, a redispatch and
a Python backend layer (``torch._dynamo`` disabled, ``wrap_triton`` turned off, an aliasing check) before it reaches
the op's body: 80–110 µs of host time per call on the project's CPU machine, against ~45 µs for the Triton
verification op's body itself (``benchmarks/triton_host_overhead.py``, benchmarks/RESULTS.md). For plain tensors with
no mode, tracer or profiler active, it ends in the body with the same arguments, so the ops' Python front ends
(``triton_backend.verify``/``sample``) call the body directly there, with the kernels themselves (what
``wrap_triton`` hands back inside the op in eager mode). Everywhere else (``torch.compile``, ``make_fx`` and export,
fake or functional tensors, a ``TorchDispatchMode`` or ``TorchFunctionMode`` such as an op counter or
``with torch.device(...)``, ``vmap``/``grad``, ``torch.jit.trace``, the autograd profiler, inputs that require grad)
the call goes through the registered op: its registration is what those layers see.
"""

import torch

__all__ = ["kernel_itself", "plain_eager"]

# Keys in the thread's include set while some layer would act between the caller and the op's body: any Python
# dispatch mode (fake, functional, proxy and user modes all include the Python key while active), functorch's
# transforms (vmap, grad). BackendSelect and ADInplaceOrView are included in every plain eager call.
_PYTHON_KEY = torch._C.DispatchKey.Python
_FUNCTORCH_KEY = torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode


def plain_eager(args) -> bool:
    """Whether the registered op called with ``args`` (its flat arguments) would reach its body with the same
    arguments and nothing around it: not compiling or tracing, no dispatch or function mode, no functorch transform,
    no autograd profiler (its trace names the op), and every tensor a plain ``torch.Tensor`` (no subclass: fake,
    functional, DTensor, Parameter) that does not require grad. A few µs."""
    if (torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None
            or torch._C._is_torch_function_mode_enabled() or torch._C._autograd._profiler_enabled()):
        return False
    keys = torch._C._dispatch_tls_local_include_set()
    if keys.has(_PYTHON_KEY) or keys.has(_FUNCTORCH_KEY):
        return False
    return all(type(a) is torch.Tensor and not a.requires_grad for a in args if isinstance(a, torch.Tensor))


def kernel_itself(kernel):
    """The kernel: what ``wrap_triton`` returns inside a ``triton_op`` in eager mode (it turns wrapping off there),
    without its ~4-8 µs of imports and checks per launch. The op bodies' launch wrapper on the plain eager path."""
    return kernel
