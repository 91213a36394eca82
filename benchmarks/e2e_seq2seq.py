"""End-to-end encoder-decoder case: ``model.generate`` vs ``speculative_kernels.generate`` on a T5 pair.

    python benchmarks/e2e_seq2seq.py                       # tiny random T5 pair, CPU or the first GPU
    python benchmarks/e2e_seq2seq.py --target T5DIR --draft T5DIR2 --batch 4 --dtype bfloat16

``seq2seq_case(...)`` returns one dict of results (``benchmarks/e2e.py`` wires it in). Both sides run on the same
encoder inputs with the same settings, after one warm-up each; times are medians over ``repeats`` runs with the
device synchronised around each, so they include the encoder forward of every model. With random weights the
acceptance rate says little about real checkpoints: pass ``target``/``draft`` (models or local folders) for that.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_name  # noqa: E402
import speculative_kernels as sk  # noqa: E402
from speculative_kernels.timing import timed_median  # noqa: E402


def tiny_t5_pair(vocab: int = 512, hidden: int = 256, target_layers: int = 6, draft_layers: int = 1, seed: int = 0,
                 deep_scale: float = 0.1):
    """A random T5 target and a shallow T5 draft that is the target's first ``draft_layers`` blocks (encoder and
    decoder) with its embeddings and final norms. The target's deeper blocks write ``deep_scale`` times their usual
    output into the residual stream, so the draft predicts the target often but not always (as a real draft does);
    the target still runs every layer, so its cost is that of the full model."""
    from transformers import T5Config, T5ForConditionalGeneration

    def make(layers):
        torch.manual_seed(seed)
        config = T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // 8, d_ff=4 * hidden, num_layers=layers,
                          num_heads=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                          initializer_factor=3.0)
        return T5ForConditionalGeneration(config).eval()

    target, draft = make(target_layers), make(draft_layers)
    with torch.no_grad():
        for stack in (target.encoder, target.decoder):
            for block in stack.block[draft_layers:]:
                for layer in block.layer:  # self-attention, (cross-attention,) feed-forward: scale what they add
                    out = getattr(layer, "SelfAttention", None) or getattr(layer, "EncDecAttention", None)
                    (out.o if out is not None else layer.DenseReluDense.wo).weight.mul_(deep_scale)
    draft.load_state_dict(target.state_dict(), strict=False)  # same-name tensors: embeddings, first blocks, norms
    return target, draft


def _load(model_or_path, device, dtype):
    if isinstance(model_or_path, (str, Path)):
        from speculative_kernels.model_loading import load_model

        model, _ = load_model(model_or_path, device=str(device), dtype=None)
        return model.to(dtype=dtype)
    return model_or_path.to(device=device, dtype=dtype)


def seq2seq_case(target=None, draft=None, *, batch: int = 1, source_length: int = 64, max_new_tokens: int = 64,
                 gamma: int = 4, do_sample: bool = False, temperature: float = 1.0, device: str | None = None,
                 dtype: torch.dtype = torch.float32, repeats: int = 3, seed: int = 0) -> dict:
    """Time ``target.generate`` and ``speculative_kernels.generate`` on one batch of encoder inputs.

    target, draft: encoder-decoder models or local folders (default: ``tiny_t5_pair()``). The inputs are
    ``batch`` random sources of ``source_length`` tokens (the later rows shorter, right-padded). EOS is disabled so
    both sides generate exactly ``max_new_tokens`` per row. Returns a flat dict (times in s, tokens/s, speed-up,
    acceptance statistics, and for greedy whether the outputs are identical).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if target is None or draft is None:
        target, draft = tiny_t5_pair()
    target, draft = _load(target, device, dtype), _load(draft, device, dtype)
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    ids = torch.randint(3, vocab, (batch, source_length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch):  # different source lengths: right padding, as seq2seq tokenizers pad
        cut = source_length - row * source_length // (2 * batch)
        ids[row, cut:], mask[row, cut:] = target.config.pad_token_id, 0
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens,
                  do_sample=do_sample, eos_token_id=None, forced_eos_token_id=None)
    if do_sample:
        kwargs["temperature"] = temperature
    # generate overwrites the stats each call: they are the last run's, and every run's, since each call is seeded
    # alike (torch.manual_seed below; with seed=None generate keys its random numbers from torch's generator)
    stats = sk.SpeculationStats()

    def baseline():
        torch.manual_seed(seed)
        with torch.inference_mode():
            return target.generate(ids, **kwargs)

    def speculative():
        torch.manual_seed(seed)
        return sk.generate(target, ids, draft_model=draft, num_speculative_tokens=gamma, speculation_stats=stats,
                           **kwargs)

    expected, base_s = timed_median(baseline, device, repeats)
    got, spec_s = timed_median(speculative, device, repeats)
    new_tokens = batch * max_new_tokens
    # every row-step emits its accepted drafts plus one token (EOS is off): the histogram must add up to the tokens
    emitted = sum((n + 1) * k for n, k in enumerate(stats.accepted_histogram))
    if emitted != new_tokens:
        raise RuntimeError(f"SpeculationStats' accepted_histogram adds up to {emitted} tokens, not the {new_tokens} "
                           "generated: the statistics are wrong")
    return {
        "case": "seq2seq",
        "model": f"{type(target).__name__}/{type(draft).__name__}",
        "target_params_m": sum(p.numel() for p in target.parameters()) / 1e6,
        "draft_params_m": sum(p.numel() for p in draft.parameters()) / 1e6,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "dtype": str(dtype).replace("torch.", ""),
        "batch": batch, "source_length": source_length, "max_new_tokens": max_new_tokens, "gamma": gamma,
        "do_sample": do_sample,
        "baseline_s": base_s, "speculative_s": spec_s,
        "baseline_tokens_per_s": new_tokens / base_s, "speculative_tokens_per_s": new_tokens / spec_s,
        "speedup": base_s / spec_s,
        "acceptance_rate": stats.acceptance_rate,
        "mean_tokens_per_target_forward": stats.mean_tokens_per_target_forward,
        "accepted_histogram": list(stats.accepted_histogram),
        "identical": None if do_sample else bool(torch.equal(got, expected)),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="local encoder-decoder folder (default: tiny random T5 pair)")
    parser.add_argument("--draft")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--source-length", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = seq2seq_case(args.target, args.draft, batch=args.batch, source_length=args.source_length,
                          max_new_tokens=args.max_new_tokens, gamma=args.gamma, do_sample=args.sample,
                          device=args.device, dtype=getattr(torch, args.dtype), repeats=args.repeats)
    print(json.dumps(result, indent=2))
    return 0 if result["identical"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
