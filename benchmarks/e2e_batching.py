"""End-to-end batching table: tokens/s of ``model.generate``, HF assisted generation (batch 1) and
``speculative_kernels.generate`` with the dynamic cache, the static cache and the compiled static path.

    python benchmarks/e2e_batching.py --tiny                  # tiny random Llama pair on CPU (or the first GPU)
    python benchmarks/e2e_batching.py --target DIR --draft DIR2 --batch-sizes 1 4 16 64 --dtype bfloat16

``batching_cases(target, draft, prompts, batch_sizes)`` returns one row (a dict) per (method, batch size);
``benchmarks/e2e.py`` can wire it in. Every method runs on the same left-padded batch with the same settings; each
row is the run with the median tokens/s of ``repeats`` runs after one warm-up run (its tokens over its own time:
sampled runs with an EOS differ in length), with the device synchronised around each run. The compiled
path's warm-up (compilation, CUDA-graph recording) is reported separately (``warmup_s``) and is not in its time. EOS
is disabled by default so every method generates exactly ``max_new_tokens`` per row (pass ``eos_token_id`` to let
rows finish early, which exercises the dropping of finished rows).
"""

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_name, hf_compile_config  # noqa: E402
import speculative_kernels as sk  # noqa: E402
from speculative_kernels.timing import median_run, timed_runs  # noqa: E402
from speculative_kernels import CompileOptions  # noqa: E402

# hf_static: model.generate with HF's static cache, compiled (HF compiles it on its own on CUDA; on other devices
# through a CompileConfig allowing them): the baseline of our compiled path.
# draft_static: the draft alone the same way, at batch 1: with hf_static it gives c for compiled decoding.
METHODS = ("hf", "hf_assisted", "hf_static", "draft_static", "dynamic", "static", "compiled")


def tiny_pair(vocab: int = 512, hidden: int = 128, target_layers: int = 4, draft_layers: int = 1, seed: int = 0,
              deep_scale: float = 0.1):
    """A random Llama target and a draft made of its first ``draft_layers`` layers (embeddings, norm, head shared).
    The deeper target layers add ``deep_scale`` times their usual output, so the draft often (not always) agrees."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(layers):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return LlamaForCausalLM(config).eval()

    target, draft = make(target_layers), make(draft_layers)
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(deep_scale)
            layer.mlp.down_proj.weight.mul_(deep_scale)
    draft.load_state_dict(target.state_dict(), strict=False)
    return target, draft


def new_token_count(new: torch.Tensor, eos_token_id) -> int:
    """Tokens generated in new [B, T] (the new columns of a batch's output): each row's up to and including its first
    EOS (the padding after it is not generated; a real token equal to the pad id counts), all T without EOS."""
    if eos_token_id is None:
        return new.numel()
    eos = torch.isin(new, torch.as_tensor(eos_token_id, device=new.device))
    first = torch.where(eos.any(dim=1), eos.int().argmax(dim=1) + 1, torch.full_like(eos[:, 0], new.shape[1],
                                                                                     dtype=torch.int64))
    return int(first.sum())


def random_prompts(count: int, vocab: int, min_length: int = 8, max_length: int = 48, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, max_length + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def left_padded(prompts: list, batch: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``batch`` prompts (cycled), left-padded: (input_ids [B, L], attention_mask [B, L])."""
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


_clock = time.perf_counter  # set by --clock (process: time.process_time, this process's CPU time)


def _method_call(method, target, draft, ids, mask, kwargs, gamma, compile_options):
    """A function of one ``SpeculationStats`` (filled in by our methods, unused by HF's) that runs the method once."""
    if method == "hf":
        return lambda stats: target.generate(ids, attention_mask=mask, **kwargs)
    if method == "hf_static":
        return lambda stats: target.generate(ids, attention_mask=mask, cache_implementation="static",
                                             compile_config=hf_compile_config(), **kwargs)
    if method == "draft_static":
        return lambda stats: draft.generate(ids, attention_mask=mask, cache_implementation="static",
                                            compile_config=hf_compile_config(), **kwargs)
    if method == "hf_assisted":
        return lambda stats: target.generate(ids, attention_mask=mask, assistant_model=draft,
                                             num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant",
                                             **kwargs)
    extra = {"dynamic": {}, "static": {"cache_implementation": "static"}, "compiled": {"compile": compile_options}}
    return lambda stats: sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=gamma,
                                     speculation_stats=stats, **extra[method], **kwargs)


def batching_cases(target, draft, prompts, batch_sizes=(1, 4, 16, 64), *, methods=METHODS, max_new_tokens: int = 64,
                   gamma: int = 4, do_sample: bool = False, eos_token_id=None, compiled_batch_sizes=(1,),
                   compile_options: CompileOptions | None = None, repeats: int = 3, seed: int = 0,
                   on_row=None) -> list[dict]:
    """Rows of the table: one dict per (method, batch size) that applies, in the order of ``methods`` within each
    batch size; ``on_row(row)``, if given, is called with each row as soon as it is measured (a run stopped at a time
    limit keeps what it printed).

    target, draft: HF causal LMs on one device; prompts: token-id lists (cycled to fill a batch). HF assisted
    generation runs at batch 1 only (as transformers allows); the compiled path at ``compiled_batch_sizes``.
    Each row: method, batch, seconds and tokens/s (of the median-rate run), speed-up (ratio of tokens/s) over
    ``model.generate`` at that batch, acceptance
    and tokens per target forward (ours), warm-up seconds (compiled), compactions and dropped rows (ours), and for
    greedy decoding whether the tokens equal ``model.generate``'s.
    """
    device = next(target.parameters()).device
    compile_options = compile_options or CompileOptions()
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, eos_token_id=eos_token_id, pad_token_id=0)
    rows = []
    for batch in batch_sizes:
        ids, mask = left_padded(prompts, batch, 0, device)
        baseline_rate, expected = None, None
        for method in methods:
            batch_one_only = method in ("hf_assisted", "draft_static")
            if (batch_one_only and batch != 1) or (method in ("compiled", "hf_static") and batch not in compiled_batch_sizes):
                continue
            row_start = time.perf_counter()
            call = _method_call(method, target, draft, ids, mask, kwargs, gamma, compile_options)
            # each call fills a stats object of its own, made before the timed calls (``generate`` overwrites the
            # one it is given): the chosen run's are reported
            unused = iter([sk.SpeculationStats() for _ in range(repeats + 3)])  # (at most 2 warm-ups + 1 + repeats)
            used = []

            def run(call=call, unused=unused, used=used):
                used.append(next(unused))
                torch.manual_seed(seed)
                with torch.inference_mode():
                    return call(used[-1])

            warmup_s = 0.0
            if method == "compiled":
                run()  # compiles and records; its warm-up time is in its stats
                warmup_s = used[0].warmup_time_s
            elif method in ("hf_static", "draft_static"):
                start = time.perf_counter()
                run()  # HF compiles its static-cache forward on the first calls
                run()
                warmup_s = time.perf_counter() - start
            timed = timed_runs(run, device, repeats, _clock)
            counts = [new_token_count(out[:, ids.shape[1]:], eos_token_id) for out, _ in timed]
            chosen = median_run(counts, [seconds for _, seconds in timed])  # the run of median tokens/s
            (out, seconds), new_tokens = timed[chosen], counts[chosen]
            stats = used[len(used) - len(timed) + chosen]  # (the timed calls are the last ones)
            if method == "hf":
                baseline_rate, expected = new_tokens / seconds, out
            ours = method in ("dynamic", "static", "compiled")
            rows.append({
                "method": method, "batch": batch, "seconds": seconds, "tokens_per_s": new_tokens / seconds,
                "speedup_vs_hf": new_tokens / seconds / baseline_rate if baseline_rate else None,
                "gamma": gamma if ours else None,
                "acceptance_rate": stats.acceptance_rate if ours else None,
                # (the MLE's successes and tests, as e2e.py's rows: a prediction for this row uses its own alpha)
                "accept_tests": [stats.accept_tests_passed, stats.accept_tests] if ours else None,
                "tokens_per_target_forward": stats.mean_tokens_per_target_forward if ours else None,
                "warmup_s": warmup_s if method in ("compiled", "hf_static", "draft_static") else None,
                "compactions": stats.compactions if ours else None,
                "dropped_rows": stats.dropped_rows if ours else None,
                "identical_to_hf": (None if do_sample or expected is None or method in ("hf", "draft_static")
                                    else bool(torch.equal(out, expected))),
                "wall_s": time.perf_counter() - row_start,  # the row's whole cost: warm-up, compiles, repeats
            })
            if on_row is not None:
                on_row(rows[-1])
    return rows


def environment(target, draft, dtype) -> dict:
    device = next(target.parameters()).device
    return {
        "model": f"{type(target).__name__}/{type(draft).__name__}",
        "target_params_m": sum(p.numel() for p in target.parameters()) / 1e6,
        "draft_params_m": sum(p.numel() for p in draft.parameters()) / 1e6,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "transformers": transformers.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def format_table(rows: list[dict]) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt) if fmt else str(value)

    columns = [("method", "method", ""), ("batch", "B", ""), ("tokens_per_s", "tok/s", ".1f"),
               ("speedup_vs_hf", "x HF", ".2f"), ("acceptance_rate", "accept", ".2f"),
               ("tokens_per_target_forward", "tok/fwd", ".2f"), ("warmup_s", "warm-up s", ".1f"),
               ("compactions", "compact", ""), ("dropped_rows", "dropped", ""), ("identical_to_hf", "same", "")]
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[k], f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def _load(path, device, dtype):
    from speculative_kernels.model_loading import load_model

    model, _ = load_model(path, device=str(device), dtype=None)
    return model.to(dtype=dtype).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama pair, small sizes (CPU friendly)")
    parser.add_argument("--target", help="local causal-LM folder")
    parser.add_argument("--draft")
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--compiled-batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--eos", type=int, help="EOS id (default: none, every row runs to max_new_tokens)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled path")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows and the environment to this file")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="process: this process's CPU time (--device cpu on a shared machine)")
    args = parser.parse_args(argv)
    global _clock
    _clock = time.process_time if args.clock == "process" else time.perf_counter
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.clock == "process" and device.type != "cpu":
        parser.error("--clock process times CPU work only: use it with --device cpu")
    dtype = getattr(torch, args.dtype)
    if args.target:
        target, draft = _load(args.target, device, dtype), _load(args.draft, device, dtype)
    elif args.tiny:
        target, draft = (m.to(device=device, dtype=dtype) for m in tiny_pair())
    else:
        parser.error("pass --tiny or --target/--draft")
    batch_sizes = args.batch_sizes or ([1, 4, 16] if args.tiny else [1, 4, 16, 64])
    max_new = args.max_new_tokens or (32 if args.tiny else 128)
    prompts = random_prompts(max(batch_sizes), target.config.vocab_size)
    rows = batching_cases(target, draft, prompts, batch_sizes, methods=args.methods, max_new_tokens=max_new,
                          gamma=args.gamma, do_sample=args.sample, eos_token_id=args.eos,
                          compiled_batch_sizes=args.compiled_batch_sizes,
                          compile_options=CompileOptions(backend=args.compile_backend), repeats=args.repeats)
    env = environment(target, draft, dtype)
    print(json.dumps(env))
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    return 0 if all(r["identical_to_hf"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
