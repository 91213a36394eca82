"""Shared benchmark helpers: timing (triton's do_bench on GPU, a median timer on CPU), result files, tables, plots.

Timing on CUDA:
* eager: ``triton.testing.do_bench`` (median; it flushes L2 before every timed call, so eager numbers are cold-L2
  and include the host's launch overhead whenever the host is slower than the GPU);
* ``cuda_graph=True``: ``triton.testing.do_bench_cudagraph`` (median over replays of a graph of many calls, no
  host overhead, warm L2 unless the caller rotates input sets, see ``rotate``).
"""

import csv
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch


def cpu_name() -> str:
    """The CPU's model name ("AMD EPYC ...", "Intel(R) Xeon(R) ..."): ``platform.processor()`` says only "x86_64"
    on Linux, and tables from different VMs must not be compared as one machine's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hf_compile_config():
    """HF's default ``CompileConfig``, allowed on every device: HF compiles a static-cache ``generate`` on its own on
    CUDA only, so on the CPU a static-cache ``model.generate`` would otherwise decode eagerly, not as the compiled
    peer of ``compile=True``."""
    import transformers

    config = transformers.CompileConfig()
    config._compile_all_devices = True  # (a class attribute of CompileConfig, not a constructor argument)
    return config


def code_measured() -> dict:
    """Which speculative_kernels the process imported: its folder, and that checkout's commit and whether it has
    uncommitted changes (None where it is not a git checkout). Recorded beside results: a benchmark puts its own
    checkout first on sys.path, so a PYTHONPATH pointing at another checkout does not change what it measures."""
    import subprocess

    import speculative_kernels

    package = Path(speculative_kernels.__file__).resolve().parent
    def git(*args):
        done = subprocess.run(["git", "-C", str(package.parent), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"package": str(package), "commit": commit, "uncommitted_changes": None if commit is None else bool(status)}


def environment(device: str) -> dict:
    """Where and with what the numbers were taken (written beside every result)."""
    import triton

    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "code": code_measured(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = cpu_name()
    return info


def rotate(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``calls`` round-robin (each on its own input set: cold L2 when their total exceeds it).

    Under CUDA-graph capture the rotation is frozen into the graph: replay i runs call i mod len(calls)."""
    state = {"i": 0}

    def call():
        fn = calls[state["i"] % len(calls)]
        state["i"] += 1
        return fn()

    return call


def time_us(fn: Callable[[], object], device: str, cuda_graph: bool = False, warmup: int = 3, reps: int = 20,
            rep_ms: float = 100) -> float:
    """Median microseconds per call of ``fn`` (GPU: over ``rep_ms`` milliseconds of repeats; CPU: ``reps`` calls)."""
    if device == "cuda":
        import triton.testing

        if cuda_graph:
            return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def markdown_table(rows: list[dict], columns: Sequence[str]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def save(rows: list[dict], meta: dict, stem: Path) -> list[Path]:
    """Write ``stem``.csv (rows, with the environment repeated per row) and ``stem``.json (environment + rows)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = stem.with_suffix(".csv"), stem.with_suffix(".json")
    full = [{**meta, **r} for r in rows]
    columns = list(dict.fromkeys(k for r in full for k in r))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(full)
    json_path.write_text(json.dumps({"environment": meta, "results": rows}, indent=1))
    return [csv_path, json_path]


def plot_vs_batch(rows: list[dict], path: Path, panel_keys: Sequence[str], line_key: str = "backend") -> Path | None:
    """µs vs batch size, one panel per value of ``panel_keys`` and one line per ``line_key``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)")
        return None
    panels = sorted({tuple(r[k] for k in panel_keys) for r in rows}, key=str)
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        sub = [r for r in rows if tuple(r[k] for k in panel_keys) == panel and r.get("us") is not None]
        for line in sorted({r[line_key] for r in sub}):
            pts = sorted((r["batch"], r["us"]) for r in sub if r[line_key] == line)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("µs / call")
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(panel_keys, panel)), fontsize=9)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
