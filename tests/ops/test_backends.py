"""Backend selection where Triton cannot run (torch < 2.6 without ``torch.library.triton_op``/``wrap_triton``, or no
importable triton): ``auto`` falls back to the torch reference and logs why; ``"triton"`` asked by name raises."""

import logging
import sys

import pytest
import torch

from speculative_kernels.ops import backends


@pytest.fixture
def fresh_selection(monkeypatch):
    """A clean once-per-process choice, with the CUDA extension unavailable, as on a GPU machine without it."""
    monkeypatch.setattr(backends, "_unavailable_reason", _without_cuda_extension(backends._unavailable_reason))
    backends._auto_backend.cache_clear()
    yield
    backends._auto_backend.cache_clear()


def _without_cuda_extension(reason_of):
    return lambda name, device_type: "no extension here" if name == "cuda" else reason_of(name, device_type)


def _assert_falls_back(caplog, because):
    with caplog.at_level(logging.WARNING, logger="speculative_kernels"):
        assert backends.resolve("auto", "cuda") == "torch"
        assert backends.resolve("auto", "cuda") == "torch"  # chosen once: logged once
    triton_lines = [r.getMessage() for r in caplog.records if "'triton' unavailable" in r.getMessage()]
    assert len(triton_lines) == 1 and because in triton_lines[0], caplog.text
    with pytest.raises(RuntimeError, match=f"backend 'triton' cannot run: .*{because}"):
        backends.resolve("triton", "cuda")


def test_auto_picks_triton_when_it_can_run(fresh_selection):
    assert backends.resolve("auto", "cuda") == "triton"  # the control: the fallbacks below are caused by the patch


@pytest.mark.parametrize("api", ["triton_op", "wrap_triton"])
def test_torch_without_triton_op_falls_back_with_reason(fresh_selection, monkeypatch, caplog, api):
    monkeypatch.delattr(torch.library, api)
    _assert_falls_back(caplog, f"torch.library.{api}")


def test_missing_triton_falls_back_with_reason(fresh_selection, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    _assert_falls_back(caplog, "triton is not importable")


def test_triton_36_interpreter_with_numpy_24_is_named(monkeypatch):
    """Triton 3.6's interpreter fails every kernel with a loop over a runtime bound under NumPy >= 2.4 (an obscure
    TypeError from inside the interpreter): the backend names the versions instead. Triton 3.7 and NumPy 2.3 run."""
    import numpy

    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    reason = backends._interpreter_reason("3.6.0")
    assert "3.6.0" in reason and "2.4.1" in reason and "triton >= 3.7" in reason
    assert backends._interpreter_reason("3.7.0") is None
    monkeypatch.setattr(numpy, "__version__", "2.3.5")
    assert backends._interpreter_reason("3.6.0") is None
