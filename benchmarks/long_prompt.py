"""Prefill-dominated requests: a long prompt and a few new tokens, `model.generate` against ours, interleaved.

    python benchmarks/long_prompt.py --pair random --lengths 500 1000 2000 4000 --new 8 [--static] [--padded]
        [--json OUT]

Times each call by the process's CPU time (one torch thread), HF then ours in each round, and prints the medians and
their ratio per prompt length; every output is compared with `model.generate`'s. The random pair is a 4-layer Llama
target (hidden 128, 4 heads / 2 KV heads, 8192 positions, vocabulary 512) and a 1-layer draft (hidden 64); the demo
pair has 512 positions (lengths up to 500). Greedy, gamma 4, `min_new_tokens` = `max_new_tokens` (no early EOS).
`--padded`: a batch of two rows, the second left-padded to half the length (an attention mask on both paths).
`--self-draft`: the target drafts for itself (every draft accepted: the decode steps' cost, with many new tokens).
"""

import argparse
import json
import os
import platform
import statistics
import time
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import speculative_kernels
from speculative_kernels.demo_pair import demo_model_paths


def random_llama(layers: int, hidden: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def load_pair(pair: str):
    """(target, draft, vocabulary size)."""
    if pair == "demo":
        target_dir, draft_dir = demo_model_paths()
        return (AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval(),
                AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval(), 4096)
    return random_llama(4, 128, 0), random_llama(1, 64, 1), 512


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def measure(target, draft, vocab: int, length: int, new: int, repeats: int, static: bool, padded: bool,
            self_draft: bool = False) -> dict:
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (2 if padded else 1, length))
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if padded:  # row 1: its first half is left padding
        mask = torch.ones_like(ids)
        mask[1, : length // 2] = 0
        ids[1, : length // 2] = 0
        kwargs["attention_mask"] = mask
    if static:
        kwargs["cache_implementation"] = "static"

    def hf():
        return target.generate(ids, **kwargs)

    def ours():
        return speculative_kernels.generate(target, ids, draft_model=target if self_draft else draft,
                                            num_speculative_tokens=4, **kwargs)

    same = torch.equal(hf(), ours())  # (also the warm-up)
    hf_s, ours_s = [], []
    for _ in range(repeats):
        hf_s.append(cpu_seconds(hf))
        ours_s.append(cpu_seconds(ours))
    hf_median, ours_median = statistics.median(hf_s), statistics.median(ours_s)
    return {"length": length, "new_tokens": new, "static": static, "padded": padded,
            "self_draft": self_draft, "hf_s": round(hf_median, 4),
            "ours_s": round(ours_median, 4), "ours_x_hf": round(hf_median / ours_median, 2), "same_as_hf": same}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=["random", "demo"], default="random")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="prompt lengths (default: 500 1000 2000 4000; demo: 100 250 500)")
    parser.add_argument("--new", type=int, default=8, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--static", action="store_true", help="cache_implementation='static' on both paths")
    parser.add_argument("--padded", action="store_true", help="two rows, the second left-padded to half the length")
    parser.add_argument("--self-draft", action="store_true", help="the target as its own draft (all accepted)")
    parser.add_argument("--json", help="write the rows and the environment here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    target, draft, vocab = load_pair(args.pair)
    lengths = args.lengths or ([100, 250, 500] if args.pair == "demo" else [500, 1000, 2000, 4000])
    rows = []
    for length in lengths:
        rows.append({"pair": args.pair, **measure(target, draft, vocab, length, args.new, args.repeats, args.static,
                                                     args.padded, args.self_draft)})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
               "processor": platform.processor(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
