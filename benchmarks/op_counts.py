"""The decode loop's own work: the ops it dispatches outside the two models' forwards, per draft step and per
verification iteration (``docs/architecture.md``: one iteration).

    python benchmarks/op_counts.py --paths dynamic static compiled --batch-sizes 1 8 --modes greedy sampling
    python benchmarks/op_counts.py --kernels ...    # CUDA: kernel launches outside the forwards (torch.profiler)

How "outside the models' forwards" is counted (``OpCounter``):

* ops: a ``TorchDispatchMode`` counts every aten op that reaches the dispatcher, views excluded (``OpOverload.is_view``:
  they launch nothing). A forward pre-hook and a forward hook on each model pause and resume the count, so
  everything the model's own ``forward`` runs is left out, and everything the loop, the runners (masks, positions,
  cache bookkeeping), the drafter and the ops run is counted. Hooks do nothing while dynamo traces them.
* captured steps (``compile=True``): the compiled callables are called with the dispatch modes disabled, so the
  whole captured step (mask and position bookkeeping included: on CUDA one graph replay) counts as a forward.
* kernels (``--kernels``, CUDA): ``torch.profiler`` with record_function ranges around each model forward, each
  iteration and each ``propose`` (a captured step is a forward range); a launch (``cudaLaunchKernel``,
  ``cuLaunchKernel(Ex)``, ``cudaGraphLaunch``, memcpy / memset) is the loop's when it starts inside an iteration and
  outside every forward range.

A verification iteration is ``step()`` less ``propose``; a draft step is ``propose`` / gamma. Only the iterations
that draft the full gamma are counted (the last ones, capped by the tokens left, are reported apart).
"""

import argparse
import collections
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculative_kernels.decoder import DecodeSession  # noqa: E402
from speculative_kernels.generation.hooks import per_token_hook  # noqa: E402
from speculative_kernels.generation.options import CompileOptions  # noqa: E402
from speculative_kernels.generation.request import build_loop  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts aten ops (views excluded) dispatched while active and not paused; ``watch`` pauses it inside model
    forwards. ``counts`` is a Counter of op names; ``total`` their sum."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.paused = 0
        self._handles = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def watch(self, *models) -> "OpCounter":
        """Pause counting inside each model's forward (hooks; remove with ``unwatch``)."""
        def pause(module, args):
            if not torch.compiler.is_compiling():
                self.paused += 1

        def resume(module, args, output):
            if not torch.compiler.is_compiling():
                self.paused -= 1

        for model in models:
            self._handles += [model.register_forward_pre_hook(per_token_hook(pause)),
                              model.register_forward_hook(per_token_hook(resume))]
        return self

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def run_modeless(fn):
    """``fn`` called with every dispatch mode disabled (a captured step counts as one forward)."""
    def call(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return call


def hide_captured_steps(loop) -> None:
    """Wrap the compiled steps of both runners (``compile=True``) so the counter does not see inside them."""
    for runner in (loop.target_runner, loop.drafter.runner):
        compiled = getattr(runner, "_compiled", None)
        if compiled:
            for key, fn in list(compiled.items()):
                compiled[key] = run_modeless(fn)


class PhaseSplit:
    """Per ``step()``: the counter's total during ``propose`` and during the whole step (a counter is anything with
    ``total``)."""

    def __init__(self, loop, counter):
        self.loop, self.counter = loop, counter
        self.records = []  # (gamma, ops in propose, ops in the step)
        self._propose_ops = 0
        propose = loop.drafter.propose

        def counted_propose(gamma, choose):
            before = counter.total
            out = propose(gamma, choose)
            self._propose_ops = counter.total - before
            return out

        loop.drafter.propose = counted_propose

    def step(self, session) -> None:
        self._propose_ops = 0
        before = self.counter.total
        session.step()
        self.records.append((self.loop.gamma, self._propose_ops, self.counter.total - before))


def session_for(target, draft, prompts, path: str, mode: str, gamma: int, max_new_tokens: int, pad: int):
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=None)
    if prompts.shape[0] > 1:
        kwargs["attention_mask"] = (prompts != pad).long()
    if mode == "greedy":
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
    if path in ("static", "compiled"):
        kwargs["cache_implementation"] = "static"
    compile_options = CompileOptions() if path == "compiled" else None
    torch.manual_seed(0)
    with torch.inference_mode():
        loop = build_loop(target, draft, prompts, num_speculative_tokens=gamma, compile_options=compile_options,
                          **kwargs)
    return DecodeSession(loop)


def summarize(records, gamma: int) -> dict:
    full = [(p, s) for g, p, s in records if g == gamma]
    verify = [s - p for p, s in full]
    draft = [p / gamma for p, _ in full]
    short = [(g, s - p) for g, p, s in records if g != gamma]
    return {
        "iterations": len(records),
        "full_gamma_iterations": len(full),
        "verify_ops_mean": statistics.mean(verify) if verify else None,
        "verify_ops_max": max(verify) if verify else None,
        "draft_step_ops_mean": statistics.mean(draft) if draft else None,
        "draft_step_ops_max": max(draft) if draft else None,
        "iteration_ops_mean": statistics.mean(s for _, s in full) if full else None,
        "short_iterations": short,
    }


def count_ops(target, draft, prompts, *, path="dynamic", mode="greedy", gamma=4, max_new_tokens=64, pad=0) -> dict:
    """Ops outside the models per draft step and per verification iteration (``summarize``), and the most frequent
    ops over the full-gamma iterations."""
    counter = OpCounter().watch(target, draft)
    try:
        session = session_for(target, draft, prompts, path, mode, gamma, max_new_tokens, pad)
        hide_captured_steps(session.loop)
        split = PhaseSplit(session.loop, counter)
        with torch.inference_mode(), counter:
            while not session.finished:
                split.step(session)
    finally:
        counter.unwatch()
    result = summarize(split.records, gamma)
    result["ops"] = dict(counter.counts.most_common())
    return result


class KernelCounter:
    """CUDA: kernel launches outside the models' forwards, from a ``torch.profiler`` trace (see the module
    docstring). Use as a context around the decode; then ``split`` per range."""

    # (Triton 3.x launches through the driver's cuLaunchKernelEx)
    LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")
    FORWARD, ITERATION, PROPOSE = "sk::forward", "sk::iteration", "sk::propose"

    def __init__(self):
        self._ranges = []
        self._handles = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)

    def watch(self, *models) -> "KernelCounter":
        def enter(module, args):
            if not torch.compiler.is_compiling():
                self._ranges.append(torch.profiler.record_function(self.FORWARD).__enter__())

        def leave(module, args, output):
            if not torch.compiler.is_compiling():
                self._ranges.pop().__exit__(None, None, None)

        for model in models:
            self._handles += [model.register_forward_pre_hook(per_token_hook(enter)),
                              model.register_forward_hook(per_token_hook(leave))]
        return self

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()

    def launches_per_range(self) -> list[tuple[int, int]]:
        """Per iteration range in order: (launches inside its propose range outside forwards, launches in the
        iteration outside forwards)."""
        events = self.profiler.events()
        spans = {name: sorted((e.time_range.start, e.time_range.end) for e in events if e.name == name)
                 for name in (self.FORWARD, self.ITERATION, self.PROPOSE)}
        launches = sorted(e.time_range.start for e in events if e.name in self.LAUNCHES)

        def inside(t, ranges):
            return any(a <= t <= b for a, b in ranges)

        ours = [t for t in launches if not inside(t, spans[self.FORWARD])]
        out = []
        for a, b in spans[self.ITERATION]:
            in_iteration = [t for t in ours if a <= t <= b]
            proposes = [(s, e) for s, e in spans[self.PROPOSE] if a <= s <= b]
            out.append((sum(1 for t in in_iteration if inside(t, proposes)), len(in_iteration)))
        return out


def in_range(name: str, fn):
    """``fn`` called inside a profiler range ``name``."""
    def call(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return call


def count_kernels(target, draft, prompts, *, path="dynamic", mode="greedy", gamma=4, max_new_tokens=64,
                  pad=0) -> dict:
    """CUDA kernel launches outside the models per draft step and per verification iteration."""
    counter = KernelCounter().watch(target, draft)
    try:
        session = session_for(target, draft, prompts, path, mode, gamma, max_new_tokens, pad)
        loop = session.loop
        for runner in (loop.target_runner, loop.drafter.runner):  # a captured step (a graph replay) is a forward
            for key, fn in list(getattr(runner, "_compiled", {}).items()):
                runner._compiled[key] = in_range(KernelCounter.FORWARD, fn)
        propose = loop.drafter.propose

        def ranged_propose(g, choose):
            with torch.profiler.record_function(KernelCounter.PROPOSE):
                return propose(g, choose)

        loop.drafter.propose = ranged_propose
        gammas = []
        sync = torch.cuda.synchronize if prompts.device.type == "cuda" else (lambda: None)
        sync()
        with torch.inference_mode(), counter.profiler:
            while not session.finished:
                with torch.profiler.record_function(KernelCounter.ITERATION):
                    session.step()
                gammas.append(loop.gamma)
            sync()
    finally:
        counter.unwatch()
    records = [(g, p, s) for g, (p, s) in zip(gammas, counter.launches_per_range())]
    return summarize(records, gamma)


def load_pair(name: str, device, dtype):
    """(target, draft, prompt token ids [1, L], pad id): "demo", the shipped pair; "layered", the demo target with its
    first layers as the draft."""
    from speculative_kernels.demo import BUILTIN_PROMPTS
    from speculative_kernels.demo_pair import load_demo_pair

    target, draft, tokenizer = load_demo_pair(dtype=dtype, device=device)
    ids = tokenizer(BUILTIN_PROMPTS[0], return_tensors="pt")["input_ids"].to(device)
    return target, draft, ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def batch_prompts(ids: torch.Tensor, batch: int, pad: int) -> torch.Tensor:
    """[batch, L] left-padded: row b is the prompt without its first 3 * b tokens."""
    length = ids.shape[1]
    rows = []
    for b in range(batch):
        cut = min(3 * b, length - 2)
        row = torch.full((length,), pad, dtype=ids.dtype, device=ids.device)
        row[cut:] = ids[0, cut:]
        rows.append(row)
    return torch.stack(rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", nargs="+", default=["dynamic", "static", "compiled"],
                   choices=["dynamic", "static", "compiled"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--modes", nargs="+", default=["greedy", "sampling"], choices=["greedy", "sampling"])
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--kernels", action="store_true", help="CUDA: count kernel launches with torch.profiler")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kernels and not args.device.startswith("cuda"):
        raise SystemExit("--kernels counts CUDA kernel launches: use --device cuda")
    torch.set_num_threads(1)
    device = torch.device(args.device)
    target, draft, ids, pad = load_pair("demo", device, torch.float32)
    count = count_kernels if args.kernels else count_ops
    rows = []
    for path in args.paths:
        for batch in args.batch_sizes:
            for mode in args.modes:
                prompts = batch_prompts(ids, batch, pad)
                result = count(target, draft, prompts, path=path, mode=mode, gamma=args.gamma,
                               max_new_tokens=args.max_new_tokens, pad=pad)
                rows.append({"path": path, "batch": batch, "mode": mode, **result})
                print(f"{path:9s} B={batch:<2d} {mode:8s} verify/iter {result['verify_ops_mean']!s:>6.6} "
                      f"(max {result['verify_ops_max']})  per draft step {result['draft_step_ops_mean']!s:>6.6} "
                      f"(max {result['draft_step_ops_max']})  iterations {result['full_gamma_iterations']}"
                      f"/{result['iterations']}", flush=True)
                if "ops" in result:
                    print("    " + ", ".join(f"{k} {v}" for k, v in list(result["ops"].items())[:14]), flush=True)
    unit = "kernel launches" if args.kernels else "aten ops (views excluded)"
    out = {"unit": unit, "gamma": args.gamma, "max_new_tokens": args.max_new_tokens, "device": args.device,
           "torch": torch.__version__, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
