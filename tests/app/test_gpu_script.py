"""benchmarks/gpu.py: the GPU issue's target checks, computed from result rows (the dry run itself runs in CI)."""

import importlib.util
from pathlib import Path

import pytest

GPU_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_run", GPU_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(backend, timing, mode, batch, us, gbps=None, speedup=None):
    return dict(backend=backend, timing=timing, mode=mode, batch=batch, k=4, vocab=128256, us=us, gbps=gbps,
                speedup_vs_torch=speedup)


def test_verify_targets_read_the_right_rows(gpu):
    rows = [_row("cuda", "graph", "greedy", 1, 6.0, 200.0), _row("cuda", "graph", "greedy", 64, 80.0, 1500.0),
            _row("cuda", "eager", "greedy", 1, 12.0, 100.0, 9.0), _row("triton", "graph", "greedy", 1, 11.0, 90.0),
            _row("cuda", "graph", "greedy", 1, 1.0, 1.0) | {"k": 8}]  # another K: must not be read
    checks = {c["target"]: c for c in gpu.verify_targets(rows, copy_gbps=3000.0)}
    assert checks["cuda greedy B=1 graph < 10 us"] == {"target": "cuda greedy B=1 graph < 10 us", "value": 6.0,
                                                      "met": True}
    assert checks["cuda greedy B=64 >= 0.6 of copy bandwidth"]["value"] == pytest.approx(0.5)
    assert not checks["cuda greedy B=64 >= 0.6 of copy bandwidth"]["met"]
    assert not checks["cuda greedy B=1 eager >= 10x torch"]["met"]
    assert not checks["triton greedy B=1 graph < 10 us"]["met"]
    assert not any("sampling" in name for name in checks)  # no sampling rows: no sampling checks


def test_e2e_targets_compare_compiled_with_static_cache_generate(gpu):
    from speculative_kernels.generation.gamma import expected_speedup

    batching = [dict(method="hf_static", batch=1, seconds=1.0), dict(method="draft_static", batch=1, seconds=0.2),
                dict(method="hf_assisted", batch=1, seconds=3.0),
                dict(method="compiled", batch=1, seconds=0.5, identical_to_hf=True, gamma=3, accept_tests=[86, 100]),
                dict(method="compiled", batch=4, seconds=0.01, identical_to_hf=False)]  # B=4: not the target
    # the first table ran other prompts at another gamma: its alpha must not predict the batching rows' speed-up
    case = {"rows": [dict(alpha=0.5, gamma=4)], "batching": batching}
    checks = gpu.e2e_targets(case)
    predicted = expected_speedup(0.86, 3, 0.2)
    assert checks[0]["value"] == pytest.approx(2.0 / predicted)
    assert "alpha 0.860, gamma 3" in checks[0]["target"]
    assert checks[1] == {"target": "compiled B=1 >= 1.5x HF assisted", "value": 6.0, "met": True}
    assert checks[2]["met"] is True
    assert gpu.e2e_targets({"rows": []}) == []


def test_a_tests_phase_stopped_at_its_limit_reports_from_its_log(gpu, tmp_path):
    """pytest writes its junit XML only when it ends; the -v log (xdist or not) still holds each finished test."""
    log = tmp_path / "tests.log"
    log.write_text("\n".join([
        "[gw0] [  1%] PASSED tests/ops/test_cuda_ops.py::test_a[1]",
        "[gw1] [  2%] FAILED tests/ops/test_cuda_ops.py::test_b ",
        "tests/generation/test_compile.py::test_c SKIPPED (needs a CUDA device)",
        "tests/generation/test_compile.py::test_d PASSED",
        "[gw2] [  3%] ERROR tests/generation/test_compile.py::test_e ",
        "FAILED tests/ops/test_cuda_ops.py::test_b - AssertionError",  # the -rfEs summary: not a second outcome
    ]))
    counts = gpu.log_counts(log)
    assert counts == {"tests": 5, "failures": 1, "errors": 1, "skipped": 1, "partial": True,
                      "failed": ["tests/ops/test_cuda_ops.py::test_b", "tests/generation/test_compile.py::test_e"]}
    assert gpu.log_counts(tmp_path / "missing.log") is None


def test_every_test_file_with_cuda_only_tests_runs_in_the_tests_phase(gpu):
    """A CUDA-only test outside GPU_TESTS never runs: test_row_params.py's scalar-temperature test (the CPU can only
    emulate it) was added for the next GPU run but left out of the list."""
    import re

    root = GPU_PATH.parents[1]
    listed = {name.split("::")[0] for name in gpu.GPU_TESTS}
    cuda_only = re.compile(r"skipif\(\s*not (torch\.cuda\.is_available\(\)|ON_CUDA)")
    missing = [str(path.relative_to(root)) for path in sorted((root / "tests").rglob("test_*.py"))
               if cuda_only.search(path.read_text()) and str(path.relative_to(root)) not in listed]
    assert missing == []


def test_serving_identity_reports_the_widest_first_difference(gpu, tmp_path):
    """The serving phase's summary: identity per method, and how far apart model.generate's logits were where a
    method first differed (ties and one rounding: half precision; many roundings: a defect)."""
    path = tmp_path / "serving-load.json"
    assert gpu.serving_identity(path) is None
    path.write_text('{"identical_to_generate": {"continuous": false, "static": true}, "first_differences": '
                    '{"continuous": [{"request": 3, "gap_in_spacings": 0.0}, {"request": 5, "gap_in_spacings": 1.0},'
                    ' {"request": 7, "step": 2}]}}')
    got = gpu.serving_identity(path)
    assert got == {"identical": {"continuous": False, "static": True}, "differing_requests": 3,
                   "max_gap_in_spacings": 1.0}


def test_a_forked_command_runs_as_its_own_process_would(gpu, tmp_path):
    """The dry run's commands in children forked from it (``ForkedPython``): the script runs as ``__main__`` with its
    argv, its folder first on sys.path, the environment given and the repository as its directory; its exit status,
    output (stdout and stderr), an exception's traceback, ``python -m`` and the time limit's kill are as for a
    process of its own."""
    import sys

    script = tmp_path / "job.py"
    script.write_text("import os, sys\n"
                      "print('argv', sys.argv[1:], sys.path[0] == os.path.dirname(__file__), os.getcwd())\n"
                      "print('env', os.environ.get('SK_FORKED_CHECK'), file=sys.stderr)\n"
                      "if __name__ == '__main__':\n"
                      "    if sys.argv[1] == 'raise':\n"
                      "        raise RuntimeError('raised in the child')\n"
                      "    if sys.argv[1] == 'sleep':\n"
                      "        import time; time.sleep(60)\n"
                      "    sys.exit(int(sys.argv[1]))\n")
    log = tmp_path / "job.log"
    cases = {"3": 3, "0": 0, "raise": 1}
    for arg, status in cases.items():
        result = gpu.run_logged([sys.executable, str(script), arg], log, timeout=60, forked=True,
                                extra_env={"SK_FORKED_CHECK": "yes"})
        assert result["rc"] == status and not result["timed_out"], (arg, result, log.read_text())
    text = log.read_text()
    assert f"argv ['3'] True {gpu.ROOT}" in text and "env yes" in text
    assert "RuntimeError: raised in the child" in text
    result = gpu.run_logged([sys.executable, str(script), "sleep"], log, timeout=1, forked=True)
    assert result["timed_out"] and result["seconds"] < 30
    result = gpu.run_logged([sys.executable, "-m", "json.tool", str(tmp_path / "missing.json")], log, timeout=60,
                            forked=True)
    assert result["rc"] != 0 and "missing.json" in log.read_text()
    with pytest.raises(ValueError, match="this Python's commands only"):
        gpu.ForkedPython(["/bin/echo", "x"], {}, tmp_path)


def test_the_spin_wait_tests_run_first_alone_then_the_rest_without_them(gpu, tmp_path):
    cmd = ["python", "-m", "pytest", "-v", "-n", "10", f"--junitxml={tmp_path / 'junit.xml'}", *gpu.GPU_TESTS]
    first, rest = gpu.spin_wait_tests_first(cmd, tmp_path)
    assert first == ["python", "-m", "pytest", "-v", f"--junitxml={tmp_path / 'junit.xml'}",
                     "tests/ops/test_cuda_ops.py", "-k", "single_pass",
                     f"--junitxml={tmp_path / 'junit-spin-wait.xml'}"]
    assert rest == [*cmd, "-k", "not single_pass"]
    assert "tests/ops/test_cuda_ops.py" in gpu.GPU_TESTS
    source = (gpu.ROOT / "tests" / "ops" / "test_cuda_ops.py").read_text()
    assert "def test_single_pass_kernel_matches_the_default_structure" in source
