"""End-to-end benchmark: ``speculative_kernels.generate`` vs ``model.generate`` and HF assisted generation.

    python benchmarks/e2e.py --device cpu --pair demo                         # the bundled demo pair
    python benchmarks/e2e.py --device cpu --pair demo --sweep-gamma 1,2,3,4,6,8,auto   # + speedup-vs-gamma plot
    python benchmarks/e2e.py --target DIR --draft DIR --dtype bfloat16        # any local pair
    python benchmarks/e2e.py --synthetic --alpha 0.8                          # Llama-3-8B / 3.2-1B shapes (GPU)
    python benchmarks/e2e.py --synthetic --alpha 0.8 --device cpu             # scaled-down shapes (CPU)
    python benchmarks/e2e.py --pair demo --batch-sizes 1,4,16 --seq2seq       # + batching / encoder-decoder tables
    python benchmarks/e2e.py --pair layered --early-exit      # HF's assistant_early_exit against ours

Per row (one gamma): measured alpha, c, tokens per target forward, tokens/s of the three paths on the same prompts
(batch 1, greedy unless --temperature), the speedup over plain ``model.generate`` and over HF assisted generation
(``model.generate(assistant_model=draft, num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant")``,
HF's other assisted-generation defaults unchanged), the speedup predicted by Leviathan et al. (Theorem 3.8)
(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) at the measured alpha and c, and efficiency = measured / predicted.

* alpha: maximum-likelihood acceptance probability from the accept tests of our runs
  (``SpeculationStats.alpha``: a row that stopped at n < d of its d drafts made n + 1 tests); ``accept_rate`` is
  accepted/drafted.
* c: the paper's cost coefficient, measured directly: median time of one single-token forward of the draft over
  that of the target, both with a KV cache after the first prompt, the two models' steps alternating
  (``measure_c``). The in-loop phase times (wall clock) are in
  the JSON too (``draft_ms_per_forward``, ``verify_ms_per_iteration``).
* times: the paths run interleaved per prompt, ``--repeats`` times after a warm-up; a path's tokens/s is its new
  tokens over its seconds (totals over the prompts) in the repeat with the median tokens/s (with greedy decoding,
  the median time).

Synthetic mode (label "synthetic" in every output): random-weight Llama models of realistic shapes whose proposals
agree with the target's greedy choice at a set rate alpha, while both models pay their full forward cost. Each
model's logits get one entry raised by 1e4 after its real forward (a forward hook; a gather and a scatter): the
target's at f(x), the draft's at f(x) if u(x) < alpha else at f(x) + 1, where x is the input token at that position,
f a random cyclic permutation of the vocabulary (one cycle through all V ids, so a greedy continuation never repeats
a token within V steps) and u(x) fixed uniform numbers. The target's greedy choice is therefore f(last token), known
without any extra target computation, and along a continuation the draft agrees independently with probability
alpha per position: the measured alpha estimates the set one. EOS is disabled so every path generates exactly
``--max-new-tokens``.

Results: a markdown table on stdout, JSON (and the PNG of ``--sweep-gamma``) under ``--out``. Exit status 1 if a
greedy output of ours or of HF assisted generation differs from ``model.generate``'s.
"""

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import speculative_kernels as sk  # noqa: E402
from speculative_kernels import timing  # noqa: E402
from speculative_kernels.timing import median_run  # noqa: E402
from speculative_kernels.generation.gamma import expected_speedup  # noqa: E402
from harness import code_measured, cpu_name  # noqa: E402
from speculative_kernels.generation.capabilities import cache_argument  # noqa: E402
from speculative_kernels.ops import backends  # noqa: E402

# Llama shapes: hidden, intermediate, layers, attention heads, KV heads, vocabulary; tied input/output embeddings.
SHAPES = {
    "llama3-8b": dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, tied=False),
    "llama3.2-1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True),
    # CPU scale-downs of the two (44M and 6M parameters, the 8B/1B parameter ratio; a smaller vocabulary, else the
    # draft's output layer alone would cost a third of the target step on a CPU)
    "cpu-target": dict(hidden=512, intermediate=1792, layers=8, heads=8, kv_heads=2, vocab=16384, tied=False),
    "cpu-draft": dict(hidden=256, intermediate=896, layers=2, heads=4, kv_heads=1, vocab=16384, tied=True),
    # for tests
    "tiny-target": dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512, tied=False),
    "tiny-draft": dict(hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, vocab=512, tied=True),
}
BIG_LOGIT = 1e4
COLUMNS = [("case", "case", ""), ("gamma", "γ", ""), ("alpha", "α", ".3f"), ("c", "c", ".3f"),
           ("tokens_per_target_forward", "tok/fwd", ".2f"), ("hf_tokens_per_s", "HF tok/s", ".1f"),
           ("assisted_tokens_per_s", "HF assisted tok/s", ".1f"), ("ours_tokens_per_s", "ours tok/s", ".1f"),
           ("speedup_vs_hf", "× HF", ".2f"), ("speedup_vs_assisted", "× assisted", ".2f"),
           ("predicted_speedup", "predicted ×", ".2f"), ("efficiency", "efficiency", ".2f"),
           ("identical", "same output", "")]


# ------------------------------------------------------------------------------------------------ synthetic pair
def llama_from_shape(shape: dict, device, dtype, seed: int = 0):
    """A random-weight LlamaForCausalLM of ``shape`` (built directly on ``device`` in ``dtype``); EOS disabled."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         tie_word_embeddings=shape["tied"], max_position_embeddings=8192,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    return model.eval()


class ControlledAcceptance:
    """The forward hooks of the synthetic mode (see the module docstring).

    target_next: [V] f, a single-cycle permutation; draft_next: [V] f(x) where u(x) < alpha, else f(x) + 1 mod V."""

    def __init__(self, vocab: int, alpha: float, device, seed: int = 0):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(vocab, generator=g)
        target_next = torch.empty(vocab, dtype=torch.int64)
        target_next[order] = order.roll(-1)  # order[i] -> order[i + 1]: one cycle through every id
        agree = torch.rand(vocab, generator=g) < alpha
        self.alpha = alpha
        self.target_next = target_next.to(device)
        self.draft_next = torch.where(agree, target_next, (target_next + 1) % vocab).to(device)

    @staticmethod
    def _hook(table):
        def hook(module, args, kwargs, output):
            ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
            logits = output.logits  # [B, T', V], the last T' <= T positions of ids [B, T]
            chosen = table[ids[:, ids.shape[1] - logits.shape[1]:]]
            logits.scatter_(-1, chosen.unsqueeze(-1), BIG_LOGIT)
            return output

        return hook

    def attach(self, target, draft) -> list:
        """Register the hooks; returns their handles (``.remove()`` restores the models)."""
        return [target.register_forward_hook(sk.per_token_hook(self._hook(self.target_next)), with_kwargs=True),
                draft.register_forward_hook(self._hook(self.draft_next), with_kwargs=True)]


def synthetic_pair(alpha: float, target_shape: str, draft_shape: str, device, dtype, seed: int = 0):
    """(target, draft) with controlled acceptance hooks attached."""
    target = llama_from_shape(SHAPES[target_shape], device, dtype, seed)
    draft = llama_from_shape(SHAPES[draft_shape], device, dtype, seed + 1)
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"shapes {target_shape} and {draft_shape} have different vocabularies")
    ControlledAcceptance(target.config.vocab_size, alpha, device, seed).attach(target, draft)
    return target, draft


LAYERED_SHAPE = dict(hidden=256, intermediate=768, layers=12, heads=8, kv_heads=2, vocab=1024, tied=False)


LAYERED_DRAFT_LAYERS = 3


def layered_pair(device, dtype, draft_layers: int = LAYERED_DRAFT_LAYERS, scale: float = 0.003, seed: int = 0):
    """(target, draft): a random-weight 12-layer Llama whose layers past the first ``draft_layers`` write
    ``scale`` times less into the residual stream (their o_proj and down_proj scaled down), and as its draft its first
    ``draft_layers`` layers with the same embeddings, final norm and head (an early-exit draft: high acceptance,
    c about draft_layers / 12 plus the head's share). EOS disabled."""
    import copy

    target = llama_from_shape(LAYERED_SHAPE, device, dtype, seed)
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:draft_layers]
    draft.config.num_hidden_layers = draft_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:draft_layers]
    return target, draft


def random_prompts(count: int, length: int, vocab: int, device, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, length), generator=g).to(device) for _ in range(count)]


# ------------------------------------------------------------------------------------------------ measurements
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_clock = time.perf_counter  # set by --clock


def timed_generate(fn, device):
    """(result, seconds) of fn() on the --clock: wall (time.perf_counter), or process (time.process_time: the CPU
    time of this process, the figure that holds on a shared CPU when torch runs one thread; not for a GPU, whose work
    it does not see)."""
    return timing.timed_generate(fn, device, _clock)


@torch.inference_mode()
def step_time(model, input_ids: torch.Tensor, steps: int = 16, repeats: int = 3) -> float:
    """Median seconds of one single-token forward with a KV cache holding ``input_ids`` [1, L]."""
    from transformers import DynamicCache

    device = input_ids.device
    arg = cache_argument(model)  # past_key_values, or cache from transformers 5.24
    times = []
    for _ in range(repeats):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=input_ids, **{arg: cache}, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out, seconds = timed_generate(lambda: model(input_ids=token, **{arg: getattr(out, arg)}, use_cache=True),
                                          device)
            token = out.logits[:, -1:].argmax(-1)
            times.append(seconds)
    return statistics.median(times)


def measure_c(target, draft, prompt: torch.Tensor, steps: int = 32, repeats: int = 3) -> dict:
    """c = draft step time / target step time (single-token forwards with a KV cache holding ``prompt`` [1, L],
    medians), with both times in ms. The two models' steps alternate, so drift on a shared machine hits both alike."""
    from transformers import DynamicCache

    device = prompt.device
    times = {"draft": [], "target": []}
    with torch.inference_mode():
        for _ in range(repeats):
            state = {}
            for name, model in (("draft", draft), ("target", target)):
                out = model(input_ids=prompt, **{cache_argument(model): DynamicCache(config=model.config)},
                            use_cache=True, logits_to_keep=1)
                state[name] = (model, out)
            for _ in range(steps):
                for name in ("draft", "target"):
                    model, out = state[name]
                    token = out.logits[:, -1:].argmax(-1)
                    arg = cache_argument(model)
                    out, seconds = timed_generate(
                        lambda: model(input_ids=token, **{arg: getattr(out, arg)}, use_cache=True), device)
                    state[name] = (model, out)
                    times[name].append(seconds)
    draft_s, target_s = statistics.median(times["draft"]), statistics.median(times["target"])
    return {"c": draft_s / target_s, "draft_step_ms": draft_s * 1e3, "target_step_ms": target_s * 1e3}


_early_exit: int | None = None  # --early-exit: both speculative paths draft with the target's first layers


def _calls(target, draft, ids, gamma, kwargs, stats):
    # (--early-exit: HF's self-speculation against ours, with the same layers; else the draft model on both)
    hf_drafting = {"assistant_model": draft} if _early_exit is None else {"assistant_early_exit": _early_exit}
    our_drafting = {"draft_model": draft} if _early_exit is None else {"assistant_early_exit": _early_exit}
    return {
        "hf": lambda: target.generate(ids, **kwargs),
        "assisted": lambda: target.generate(ids, **hf_drafting, num_assistant_tokens=gamma,
                                            num_assistant_tokens_schedule="constant", **kwargs),
        "ours": lambda: sk.generate(target, ids, **our_drafting, num_speculative_tokens=gamma,
                                    speculation_stats=stats, **kwargs),
    }


def generation_kwargs(max_new_tokens: int, temperature: float, pad_token_id: int, eos_token_id="model",
                      top_k: int = 0) -> dict:
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
    if eos_token_id != "model":
        kwargs["eos_token_id"] = eos_token_id
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0)
    else:
        kwargs["do_sample"] = False
    return kwargs


def _merge_histograms(histograms: list) -> list:
    width = max(len(h) for h in histograms)
    return [sum(h[i] for h in histograms if i < len(h)) for i in range(width)]


def run_paths(target, draft, prompts: list, gamma, kwargs: dict, repeats: int = 3, paths=("hf", "assisted", "ours"),
              seed: int = 0) -> dict:
    """Time the paths on every prompt (interleaved), ``repeats`` times after a warm-up of each.

    prompts: list of [1, L] tensors. Returns per path the seconds and new tokens of its repeat (its total over the
    prompts) with the median tokens/s (``timing.median_run``: sampled repeats differ in length, so one repeat's
    tokens over the median time would mix repeats), the outputs (last repeat), plus our statistics (last repeat)
    and whether each output equals ``model.generate``'s."""
    device = prompts[0].device
    runs = {p: [] for p in paths}  # per timed repeat: (tokens, seconds)
    outputs = {p: [] for p in paths}
    stats_per_prompt = []
    for repeat in range(repeats + 1):  # repeat 0 is the warm-up
        outputs = {p: [] for p in paths}
        stats_per_prompt = []
        seconds = {p: 0.0 for p in paths}
        for ids in prompts:
            stats = sk.SpeculationStats()
            calls = _calls(target, draft, ids, gamma, kwargs, stats)
            for path in paths:
                torch.manual_seed(seed + repeat)
                with torch.inference_mode():
                    out, s = timed_generate(calls[path], device)
                seconds[path] += s
                outputs[path].append(out[:, ids.shape[1]:])
            stats_per_prompt.append(stats)
        if repeat > 0:
            for path in paths:
                runs[path].append((sum(o.numel() for o in outputs[path]), seconds[path]))
    chosen = {p: r[median_run([t for t, _ in r], [s for _, s in r])] for p, r in runs.items()}
    result = {"seconds": {p: c[1] for p, c in chosen.items()}, "tokens": {p: c[0] for p, c in chosen.items()},
              "outputs": outputs}
    if "ours" in paths:
        result["stats"] = stats_per_prompt
    if "hf" in paths:
        result["identical"] = {p: all(torch.equal(a, b) for a, b in zip(outputs[p], outputs["hf"]))
                               for p in paths if p != "hf"}
    return result


def summarize_row(case: str, gamma, measured: dict, c_info: dict, greedy: bool) -> dict:
    """One table row from ``run_paths``' result and ``measure_c``'s."""
    stats = measured["stats"]
    histogram = _merge_histograms([s.accepted_histogram for s in stats])
    chosen = sorted({s.num_speculative_tokens for s in stats})
    fixed = gamma != "auto"
    rate = {p: measured["tokens"][p] / measured["seconds"][p] for p in measured["seconds"]}
    steps = sum(histogram)
    # At batch 1 every target forward emits its accepted drafts plus one token: the histogram must add up to the
    # tokens the last repeat generated (a statistics regression once printed tokens per forward it could not have)
    emitted = sum((n + 1) * k for n, k in enumerate(histogram))
    generated = sum(o.numel() for o in measured["outputs"]["ours"])
    if emitted != generated:
        raise RuntimeError(f"SpeculationStats' accepted_histogram adds up to {emitted} tokens, the outputs hold "
                           f"{generated}: the statistics are wrong")
    passed, tests = sum(s.accept_tests_passed for s in stats), sum(s.accept_tests for s in stats)
    row = {
        "case": case, "gamma": gamma if fixed else f"auto→{'/'.join(map(str, chosen))}",
        # "auto" can choose a different gamma per prompt: then no single gamma (and no prediction) describes the row.
        "gamma_used": gamma if fixed else (chosen[0] if len(chosen) == 1 else None),
        "gammas_chosen": [s.num_speculative_tokens for s in stats],
        # "auto" rows mix the calibration gamma with the chosen one: no single gamma to predict at
        "alpha": passed / tests if fixed and tests else None,
        "accept_tests": [passed, tests],
        "accept_rate": sum(s.accepted_tokens for s in stats) / max(1, sum(s.drafted_tokens for s in stats)),
        "accepted_histogram": histogram,
        "tokens_per_target_forward": emitted / steps if steps else None,
        **c_info,
        "draft_ms_per_forward": 1e3 * sum(s.draft_time_s for s in stats) / max(1, sum(s.draft_forwards for s in stats)),
        "verify_ms_per_iteration": 1e3 * sum(s.verify_time_s for s in stats) / max(1, sum(s.target_forwards
                                                                                        for s in stats)),
        "new_tokens": measured["tokens"].get("ours"),
    }
    for path, name in (("hf", "hf"), ("assisted", "assisted"), ("ours", "ours")):
        row[f"{name}_tokens_per_s"] = rate.get(path)
        row[f"{name}_seconds"] = measured["seconds"].get(path)
    row["speedup_vs_hf"] = rate["ours"] / rate["hf"] if "hf" in rate else None
    row["speedup_vs_assisted"] = rate["ours"] / rate["assisted"] if "assisted" in rate else None
    if "hf" in rate and "assisted" in rate:
        row["assisted_speedup_vs_hf"] = rate["assisted"] / rate["hf"]
    add_prediction(row)
    same = measured.get("identical", {})
    row["identical"] = None if not greedy else all(same.values()) if same else None
    row["identical_by_path"] = same if greedy else None
    return row


def add_prediction(row: dict, alpha: float | None = None) -> None:
    """predicted_speedup (Theorem 3.8 at alpha, gamma_used, c) and efficiency = measured / predicted."""
    alpha = row["alpha"] if alpha is None else alpha
    if alpha is None or row["gamma_used"] is None:
        row["predicted_speedup"] = row["efficiency"] = None
        return
    row["predicted_speedup"] = expected_speedup(alpha, int(row["gamma_used"]), row["c"])
    row["efficiency"] = row["speedup_vs_hf"] / row["predicted_speedup"] if row["speedup_vs_hf"] else None


def pooled_alpha(rows: list) -> float | None:
    """alpha over every fixed-gamma row (the MLE's successes and tests summed)."""
    successes = tests = 0
    for row in rows:
        if row["alpha"] is None:
            continue
        s, t = row["accept_tests"]
        successes, tests = successes + s, tests + t
    return successes / tests if tests else None


def gamma_rows(case, target, draft, prompts, gammas, kwargs, *, repeats, with_assisted=True, c_info=None,
               progress=print) -> list:
    """One row per gamma (an int or "auto"); "auto" rows are predicted at the pooled alpha of the others."""
    greedy = not kwargs.get("do_sample")
    c_info = c_info or measure_c(target, draft, prompts[0])
    paths = ("hf", "assisted", "ours") if with_assisted else ("hf", "ours")
    rows = []
    for gamma in gammas:
        progress(f"[e2e] {case}: gamma {gamma} ...")
        measured = run_paths(target, draft, prompts, gamma, kwargs, repeats=repeats, paths=paths)
        rows.append(summarize_row(case, gamma, measured, c_info, greedy))
    pooled = pooled_alpha(rows)
    for row in rows:
        if row["alpha"] is None and pooled is not None:
            row["alpha_pooled"] = pooled
            add_prediction(row, pooled)
    return rows


# ------------------------------------------------------------------------------------------------ output
def markdown_table(rows: list, columns=COLUMNS) -> str:
    def cell(value, fmt):
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        return format(value, fmt) if fmt else str(value)

    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_sweep(rows: list, path: Path, title: str) -> Path | None:
    """Measured speedup over model.generate (and over assisted) vs gamma, with the predicted curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, or the package's [bench] extra)")
        return None
    fixed = [r for r in rows if isinstance(r["gamma"], int)]
    alpha, c = pooled_alpha(fixed), rows[0]["c"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if alpha is not None:
        grid = list(range(1, max(r["gamma"] for r in fixed) + 3))
        ax.plot(grid, [expected_speedup(alpha, g, c) for g in grid], "--", color="gray",
                label=f"predicted (α={alpha:.2f}, c={c:.2f})")
    ax.plot([r["gamma"] for r in fixed], [r["speedup_vs_hf"] for r in fixed], "o-", label="measured × model.generate")
    if any(r.get("speedup_vs_assisted") for r in fixed):
        ax.plot([r["gamma"] for r in fixed], [r["speedup_vs_assisted"] for r in fixed], "s-",
                label="measured × HF assisted")
    for r in rows:
        if not isinstance(r["gamma"], int):
            at = r["gamma_used"] if r["gamma_used"] is not None else statistics.median(r["gammas_chosen"])
            ax.plot([at], [r["speedup_vs_hf"]], "*", markersize=14, label=f"γ {r['gamma']} (at the median choice)")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xlabel("γ (draft tokens per iteration)")
    ax.set_ylabel("speedup")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def environment(device, dtype) -> dict:
    device = torch.device(device)
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"CPU ({cpu_name()}, {os.cpu_count()} cores)",
        "torch_threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "verify_backend": backends.resolve("auto", device.type), "code": code_measured(),
    }


# ------------------------------------------------------------------------------------------------ optional cases
def optional_module(name: str):
    """benchmarks/<name>.py if that file exists (written by other benchmarks), else None."""
    if not (HERE / f"{name}.py").is_file():
        return None
    return importlib.import_module(name)


def batching_table(target, draft, prompts, batch_sizes, args, device, on_row=None) -> list | None:
    module = optional_module("e2e_batching")
    if module is None:
        print("benchmarks/e2e_batching.py is not there: no batching table")
        return None
    # On CUDA the compiled rows (the GPU issue's end-to-end targets) come right after the baseline, so a run cut
    # short by a time limit still has them.
    compiled = ["hf_static", "draft_static", "compiled"] if device.type == "cuda" else []
    methods = ["hf", *compiled, "hf_assisted", "dynamic", "static"]

    def print_row(row):
        print("[e2e] batching row " + json.dumps(row, default=str), flush=True)
        if on_row is not None:
            on_row(row)

    return module.batching_cases(target, draft, [p[0].tolist() for p in prompts], batch_sizes, methods=methods,
                                 max_new_tokens=args.max_new_tokens, gamma=args.batch_gamma,
                                 do_sample=args.temperature > 0, repeats=args.repeats, on_row=print_row)


def seq2seq_result(args, device, dtype) -> dict | None:
    module = optional_module("e2e_seq2seq")
    if module is None:
        print("benchmarks/e2e_seq2seq.py is not there: no encoder-decoder case")
        return None
    return module.seq2seq_case(batch=1, max_new_tokens=args.max_new_tokens, gamma=args.batch_gamma,
                               device=str(device), dtype=dtype, repeats=args.repeats)


# ------------------------------------------------------------------------------------------------ main
def _parse_gammas(text: str) -> list:
    return [g.strip() if g.strip() == "auto" else int(g) for g in text.split(",") if g.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--pair", choices=["demo", "layered"], help="the bundled demo pair (default when nothing else is "
                     "given), or a random 12-layer target with its first 3 layers as the draft (``layered_pair``)")
    src.add_argument("--target", help="local target folder (with --draft)")
    src.add_argument("--synthetic", action="store_true", help="random-weight pair with controlled acceptance")
    p.add_argument("--draft", help="local draft folder (with --target)")
    p.add_argument("--alpha", type=float, default=0.8, help="synthetic: the acceptance rate to set")
    p.add_argument("--target-shape", choices=sorted(SHAPES), help="synthetic (default: llama3-8b on GPU, "
                   "cpu-target on CPU)")
    p.add_argument("--draft-shape", choices=sorted(SHAPES), help="synthetic (default: llama3.2-1b / cpu-draft)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--threads", type=int, help="torch intra-op threads on CPU (default: torch's)")
    p.add_argument("--gamma", default="4", help="draft length of the main row (an int or 'auto')")
    p.add_argument("--sweep-gamma", type=_parse_gammas, help="comma-separated gammas (ints and/or auto): one row "
                   "each and a plot of measured and predicted speedup vs gamma")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4, help="number of prompts (built-in code prompts or random)")
    p.add_argument("--prompt-length", type=int, default=32, help="synthetic: random prompt length")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0,
                   help="top_k when sampling (0: no cut; HF's GenerationConfig default is 50)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: time.perf_counter; process: the process's CPU time (CPU runs on a loaded machine)")
    p.add_argument("--no-assisted", action="store_true", help="skip HF assisted generation")
    p.add_argument("--early-exit", action="store_true",
                   help="with --pair layered: draft with the target's own first layers (assistant_early_exit) on "
                        "both speculative paths, HF's (model.generate(assistant_early_exit=...)) and ours, instead "
                        "of a separate copy of them")
    p.add_argument("--batch-sizes", type=lambda t: [int(b) for b in t.split(",")],
                   help="also the batching table (benchmarks/e2e_batching.py), e.g. 1,4,16")
    p.add_argument("--batch-gamma", type=int, default=4, help="gamma of the batching and seq2seq cases")
    p.add_argument("--seq2seq", action="store_true", help="also the encoder-decoder case (benchmarks/e2e_seq2seq.py)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for the JSON and PNG")
    p.add_argument("--name", help="file stem (default: e2e-<case>-<device>-<date>)")
    args = p.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        p.error("--target and --draft go together")
    if args.early_exit and args.pair != "layered":
        p.error("--early-exit needs --pair layered (a target whose first layers draft)")
    return args


def load_case(args, device, dtype):
    """(case label, target, draft, prompts, pad id)."""
    if args.synthetic:
        gpu = device.type == "cuda"
        t_shape = args.target_shape or ("llama3-8b" if gpu else "cpu-target")
        d_shape = args.draft_shape or ("llama3.2-1b" if gpu else "cpu-draft")
        target, draft = synthetic_pair(args.alpha, t_shape, d_shape, device, dtype)
        prompts = random_prompts(args.prompts, args.prompt_length, target.config.vocab_size, device)
        return f"synthetic α={args.alpha:g} ({t_shape}/{d_shape})", target, draft, prompts, 0
    if args.pair == "layered":
        target, draft = layered_pair(device, dtype)
        prompts = random_prompts(args.prompts, args.prompt_length, target.config.vocab_size, device)
        if args.early_exit:  # (the draft measured for c: the same computation as the copy)
            from speculative_kernels.generation.early_exit import early_exit_draft

            draft = early_exit_draft(target, LAYERED_DRAFT_LAYERS)
            return ("layered pair, early exit (12-layer random target drafting with its first 3 layers: "
                    "assistant_early_exit=3)", target, draft, prompts, 0)
        return "layered pair (12-layer random target, its first 3 layers as the draft)", target, draft, prompts, 0
    from speculative_kernels.demo import BUILTIN_PROMPTS
    from speculative_kernels.model_loading import load_model

    if args.target:
        target_dir, draft_dir, case = args.target, args.draft, f"user pair ({Path(args.target).name}/" \
                                                                 f"{Path(args.draft).name})"
    else:
        from speculative_kernels.demo_pair import demo_model_paths

        (target_dir, draft_dir), case = demo_model_paths(), "demo pair"
    name = str(dtype).replace("torch.", "")
    target, tokenizer = load_model(target_dir, device=str(device), dtype=name)
    draft, _ = load_model(draft_dir, device=str(device), dtype=name)
    if tokenizer is None:
        raise ValueError(f"{target_dir} has no tokenizer")
    texts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(args.prompts)]
    prompts = [tokenizer(t, return_tensors="pt")["input_ids"].to(device) for t in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return case, target, draft, prompts, pad


def main(argv=None) -> int:
    args = parse_args(argv)
    global _clock, _early_exit
    _clock = CLOCKS[args.clock]
    _early_exit = LAYERED_DRAFT_LAYERS if args.early_exit else None
    device = torch.device(args.device)
    if args.clock == "process" and device.type != "cpu":
        raise SystemExit("--clock process times CPU work only: use it with --device cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if args.threads:
        torch.set_num_threads(args.threads)
    case, target, draft, prompts, pad = load_case(args, device, dtype)
    gammas = args.sweep_gamma or [args.gamma if args.gamma == "auto" else int(args.gamma)]
    random_pair = args.synthetic or args.pair == "layered"
    kwargs = generation_kwargs(args.max_new_tokens, args.temperature, pad, None if random_pair else "model",
                               top_k=args.top_k)
    rows = gamma_rows(case, target, draft, prompts, gammas, kwargs, repeats=args.repeats,
                      with_assisted=not args.no_assisted)
    env = environment(device, dtype)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    kind = 'synthetic' if args.synthetic else 'user' if args.target else args.pair or 'demo'
    kind += '-early-exit' if args.early_exit else ''
    stem = args.out / (args.name or f"e2e-{kind}-"
                                    f"{device.type}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    json_path, png_path = stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.png"  # names may hold dots
    result = {"environment": env, "settings": settings, "rows": rows}

    def save():  # after each section, so a run stopped at a time limit keeps what it measured
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1, default=str))

    save()
    print(json.dumps(env))
    print(markdown_table(rows))
    if args.sweep_gamma:
        plot = plot_sweep(rows, png_path, f"{case}, {env['device']}")
        result["plot"] = str(plot) if plot else None
    if args.batch_sizes:
        result["batching"] = []  # filled row by row, saved after each
        batching = batching_table(target, draft, prompts, args.batch_sizes, args, device,
                                  on_row=lambda row: (result["batching"].append(row), save()))
        result["batching"] = batching
        if result["batching"]:
            print(f"\nbatching ({case}):\n" + optional_module("e2e_batching").format_table(result["batching"]))
    if args.seq2seq:
        result["seq2seq"] = seq2seq_result(args, device, dtype)
        if result["seq2seq"]:
            print("\nencoder-decoder:\n" + json.dumps(result["seq2seq"]))
    save()
    print(f"wrote {json_path}" + (f" and {result['plot']}" if result.get("plot") else ""))
    return 0 if all(r["identical"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
