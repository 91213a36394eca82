"""The multi-token verification forward against a single-token step: the demo target's forward of T tokens after a
prompt of L, bare (HF's own DynamicCache, HF's own mask) and through our runners (dynamic and static cache: our mask,
position ids and cache bookkeeping), each rolled back after the call.

    OMP_NUM_THREADS=1 python benchmarks/verify_forward.py --widths 1 5 --reps 200
    OMP_NUM_THREADS=1 python benchmarks/verify_forward.py --shapes --widths 1 5 --reps 20   # by model width

``--shapes`` measures the bare forward instead on random Llamas of growing width (two layers each, the
``e2e.py`` layered pair's shape first): the width cost of a verification is the model's and the machine's, and the
paper's formula (a verification costs one step) holds only where a forward is bound by reading the weights.

The calls are interleaved (one of each kind per round, in rotating order) so drift on a shared machine hits every
kind alike; each time is the median over the rounds. On CPU each call is timed by the process's CPU time
(``time.process_time``, one torch thread), which holds on a shared machine; on CUDA by the synchronised wall clock.
"""

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from speculative_kernels.demo_pair import load_demo_pair  # noqa: E402
from speculative_kernels.generation.capabilities import cache_argument, check_model  # noqa: E402
from speculative_kernels.generation.runners.decoder import DecoderRunner  # noqa: E402
from speculative_kernels.generation.runners.dynamic_cache import crop_cache  # noqa: E402
from speculative_kernels.generation.runners.static_decoder import StaticDecoderRunner  # noqa: E402


def bare(model, prompt):
    """A call forwarding T tokens through HF's DynamicCache holding ``prompt``, then cropping them off."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    arg = cache_argument(model)  # past_key_values, or cache from transformers 5.24
    model(input_ids=prompt, **{arg: cache}, use_cache=True)
    length = prompt.shape[1]

    def call(tokens):
        positions = torch.arange(length, length + tokens.shape[1], device=tokens.device).unsqueeze(0)
        model(input_ids=tokens, position_ids=positions, **{arg: cache}, use_cache=True)
        crop_cache(cache, length)

    return call


def runner_call(runner, prompt):
    """A call forwarding T tokens through one of our runners holding ``prompt``, then rolling them back."""
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), last_only=True)
    zero = torch.zeros(prompt.shape[0], dtype=torch.int64, device=prompt.device)
    # (kept_host is newer than the runners this script also measures, for before/after comparisons)
    host = {"kept_host": [0] * prompt.shape[0]} if "kept_host" in inspect.signature(runner.keep_prefix).parameters \
        else {}

    def call(tokens):
        runner.forward(tokens)
        runner.keep_prefix(tokens.shape[1], zero, 0, **host)

    return call


def measure(calls: dict, widths, reps: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    keys = [(name, t) for name in calls for t in widths]
    times = {k: [] for k in keys}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for r in range(reps + 5):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for name, t in order:
            tokens = torch.randint(3, vocab, (1, t), generator=g).to(device)
            sync()
            start = clock()
            calls[name](tokens)
            sync()
            if r >= 5:  # warm-up rounds
                times[(name, t)].append(clock() - start)
    return {f"{name} T={t}": 1e3 * statistics.median(v) for (name, t), v in times.items()}


SHAPES = [dict(hidden=256, intermediate=768, heads=8, kv_heads=2, vocab=1024),  # e2e.py's layered pair
          dict(hidden=512, intermediate=1536, heads=8, kv_heads=2, vocab=4096),
          dict(hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=8192),
          dict(hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=8192)]


def shape_sweep(widths, reps: int, prompt_length: int, device) -> dict:
    """{shape name: {"bare T=t": ms}} for two-layer random Llamas of the ``SHAPES``."""
    from e2e import llama_from_shape

    out = {}
    for shape in SHAPES:
        model = llama_from_shape(dict(shape, layers=2, tied=False), device, torch.float32)
        prompt = torch.randint(3, shape["vocab"], (1, prompt_length),
                               generator=torch.Generator().manual_seed(1)).to(device)
        with torch.inference_mode():
            ms = measure({"bare": bare(model, prompt)}, widths, reps, shape["vocab"], device)
        name = f"hidden {shape['hidden']}, ffn {shape['intermediate']}, vocab {shape['vocab']}"
        ms[f"T={max(widths)} / T=1"] = ms[f"bare T={max(widths)}"] / ms["bare T=1"]
        out[name] = ms
        print(name, " ".join(f"{k}: {v:.3f}" for k, v in ms.items()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", nargs="+", type=int, default=[1, 5])
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path)
    p.add_argument("--shapes", action="store_true", help="the bare forward on random Llamas of growing width")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if args.shapes:
        results = shape_sweep(args.widths, args.reps, args.prompt_length, device)
        if args.json:
            args.json.write_text(json.dumps({"torch": torch.__version__, "prompt_length": args.prompt_length,
                                             "reps": args.reps, "device": str(device), "shapes": results},
                                            indent=1) + "\n")
        return 0
    target, _, _ = load_demo_pair(device=device)
    vocab = target.config.vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt_length), generator=torch.Generator().manual_seed(1)).to(device)
    capacity = args.prompt_length + max(args.widths) + 8
    with torch.inference_mode():
        calls = {
            "bare": bare(target, prompt),
            "dynamic": runner_call(DecoderRunner(target, check_model(target, path="dynamic", batch=1), 1,
                                                 capacity, device), prompt),
            "static": runner_call(StaticDecoderRunner(target, check_model(target, path="static", batch=1), 1,
                                                      capacity, device), prompt),
        }
        ms = measure(calls, args.widths, args.reps, vocab, device)
    widest = max(args.widths)
    for name in calls:
        ms[f"{name} T={widest} / T=1"] = ms[f"{name} T={widest}"] / ms[f"{name} T=1"]
        if name != "bare":
            for t in args.widths:
                ms[f"{name} / bare T={t}"] = ms[f"{name} T={t}"] / ms[f"bare T={t}"]
    for key, value in ms.items():
        print(f"{key:22s} {value:8.3f}")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "prompt_length": args.prompt_length,
                                         "reps": args.reps, "device": str(device), "results": ms}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
