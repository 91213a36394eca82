"""The caller's ambient torch state (default dtype and device, deterministic algorithms, grad mode, autocast, thread
count) changes no seeded token (autocast changes the model's logits: there the ops alone): each cheap path's output under each state is bit-identical to its output under
torch's defaults. Tensors built from Python scalars took the default dtype before (Philox's uniforms, the n-gram
drafter's weights): with float16 as default those gave token 0 or NaN drafts.
The full state x path hunt (static cache, prompt lookup, sessions, continuous batching, Triton) is in the commit log."""

import contextlib

import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama
from speculative_kernels import ops

P = torch.tensor([[1, 17, 42, 70, 7, 17, 42, 70, 7]])
SAMPLED = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=5, eos_token_id=None, max_new_tokens=6)


@contextlib.contextmanager
def _setting(get, set_, value):
    """Set a global torch setting to ``value`` for the block (``get`` reads it, ``set_`` writes it), then restore it."""
    saved = get()
    set_(value)
    try:
        yield
    finally:
        set_(saved)


@contextlib.contextmanager
def _default_device():
    torch.set_default_device("cpu")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _default_dtype(dtype):
    return _setting(torch.get_default_dtype, torch.set_default_dtype, dtype)


def _deterministic():
    return _setting(torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms, True)


def _threads(count):
    return _setting(torch.get_num_threads, torch.set_num_threads, count)


STATES = {
    "float16": lambda: _default_dtype(torch.float16),
    "bfloat16": lambda: _default_dtype(torch.bfloat16),
    "float64": lambda: _default_dtype(torch.float64),
    "set_default_device": _default_device,
    "with_device": lambda: torch.device("cpu"),
    "deterministic": _deterministic,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast_bfloat16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "one_thread": lambda: _threads(1),
}


@pytest.fixture(scope="module")
def paths():
    target, draft = llama(), llama(layers=1, seed=3)

    def verify():
        g = torch.Generator().manual_seed(0)
        target_logits = torch.randn(3, 4, 11, generator=g, dtype=torch.float32)
        draft_logits = torch.randn(3, 3, 11, generator=g, dtype=torch.float32)
        tokens = torch.randint(0, 11, (3, 3), generator=g)
        return (*ops.verify(target_logits, draft_logits, tokens, temperature=0.9, top_k=5, top_p=0.9, seed=7,
                            backend="torch"),
                ops.sample(target_logits[:, 0], temperature=0.8, top_p=0.8, seed=3, backend="torch"))

    return {
        "draft_model": lambda: sk.generate(target, P, draft_model=draft, num_speculative_tokens=3, **SAMPLED),
        "ngram_order_8": lambda: sk.generate(target, P, drafter=sk.NGramDrafter(97, order=8), **SAMPLED),
        "ops_torch": verify,
    }


@pytest.fixture(scope="module")
def expected(paths):
    return {name: run() for name, run in paths.items()}


# (autocast runs the model's forward in bfloat16: other logits, README; the ops' draws are the same)
CASES = [(state, path) for state in STATES for path in ("draft_model", "ngram_order_8", "ops_torch")
         if path == "ops_torch" or not state.startswith("autocast")]


@pytest.mark.parametrize("state, path", CASES)
def test_seeded_output_is_the_same_under_the_callers_torch_state(paths, expected, state, path):
    with STATES[state]():
        got = paths[path]()
    want = expected[path]
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
