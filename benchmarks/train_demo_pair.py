#!/usr/bin/env python
"""Train the small target/draft model pair shipped in ``speculative_kernels/demo_models/``.

Everything here runs on one CPU core in roughly 20-25 minutes and needs no network and no downloaded data:

1. **Text.** Every ``*.py`` file of the running interpreter's standard library
   (``sysconfig.get_paths()["stdlib"]``), skipping test folders, ``site-packages``, the ``encodings/`` codec tables,
   ``pydoc_data/`` (a generated help-text blob) and the machine-specific ``_sysconfigdata*`` files. A fixed ~5 % of the
   files (chosen by a hash of their relative path, so the split does not depend on the file order) is held out for
   evaluation.
2. **Tokenizer.** A byte-level BPE (``tokenizers``) with ``--vocab`` entries (default 4096), including the special
   tokens ``<|bos|>`` (0), ``<|eos|>`` (1) and ``<|pad|>`` (2); it prepends ``<|bos|>`` when encoding. It is wrapped as a
   ``PreTrainedTokenizerFast`` and saved, identically, into both model folders.
3. **Target.** A Llama-style decoder (``LlamaForCausalLM``, tied embeddings) trained on next-token loss over random
   ``--seq``-token windows of the concatenated training files, every ``--long-every``-th step ``--long-seq``-token
   windows (bf16 autocast on CPU, fp32 master weights, AdamW, warm-up + cosine learning rate). At this compute budget
   (a few million tokens) a narrow model learns much faster per CPU-second than a wide one, so the target is narrow
   (hidden 128) but deep (12 layers): on CPU a decode step's cost is dominated by per-layer overhead, so depth is what
   makes the target expensive relative to the draft.
4. **Draft.** The same architecture with only ``--draft-layers`` layers, initialised from the target's embeddings,
   first layers and final norm, then distilled from the target: loss = (1 - a) * KL(target || draft) + a * CE(text).
5. **Export and evaluation.** Both are saved as fp16 safetensors HF folders (``config.json``,
   ``generation_config.json``, ``model.safetensors``, tokenizer files), reloaded from disk in fp32 and measured:
   parameters, file sizes, held-out loss/perplexity, greedy acceptance (draft argmax == target argmax) teacher-forced
   on held-out text and on the target's own greedy continuations of held-out prompts, and the per-token decode time
   (batch 1, KV cache, fp32, median) of each model, whose ratio is ``c``. The numbers are printed and written into
   ``<out>/README.md``.

Reproducible: with the same interpreter (same stdlib files), torch version, ``--seed`` and step counts the run is
deterministic on one thread. ``--target-minutes`` / ``--draft-minutes`` are safety caps in CPU time of this process
(so a busy machine does not change them): when a phase runs out of time before its step count, it ends early with its
learning-rate schedule compressed accordingly (the log says so), and the run is no longer step-for-step
reproducible.

Usage (what produced the shipped models)::

    OMP_NUM_THREADS=1 python benchmarks/train_demo_pair.py 2>&1 | tee benchmarks/demo_pair_training.log
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "speculative_kernels" / "demo_models"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (gets target/, draft/, README.md)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch / tokenizers threads (keep 1 on shared machines)")
    # data / tokenizer
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--eval-percent", type=int, default=5, help="percent of stdlib files held out for evaluation")
    p.add_argument("--seq", type=int, default=256, help="training window length (tokens)")
    p.add_argument("--batch", type=int, default=4, help="windows per optimiser step")
    p.add_argument("--long-seq", type=int, default=512,
                   help="every --long-every-th step uses batch * seq / long_seq windows of this length instead, so "
                        "positions up to long_seq are trained too (0: off)")
    p.add_argument("--long-every", type=int, default=5)
    # target
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--target-layers", type=int, default=12)
    p.add_argument("--target-steps", type=int, default=2800)
    p.add_argument("--target-minutes", type=float, default=45.0,
                   help="CPU-time safety cap for target training (the default step count needs about 17 min)")
    p.add_argument("--target-lr", type=float, default=3e-3)
    # draft
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--draft-steps", type=int, default=2000)
    p.add_argument("--draft-minutes", type=float, default=20.0,
                   help="CPU-time safety cap for draft distillation (the default step count needs about 7 min)")
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--ce-weight", type=float, default=0.1, help="weight a of the next-token loss in the draft loss")
    # logging / eval
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens for the final loss / acceptance")
    p.add_argument("--gen-prompts", type=int, default=16, help="held-out prompts for the greedy-continuation test")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--timing-steps", type=int, default=200, help="decode steps per timing round")
    p.add_argument("--gamma", type=int, default=4, help="draft length used for the simulated speculative numbers")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------------------- data
def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        if p.is_file():
            files.append(p)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return root, files


def is_heldout(rel: str, percent: int) -> bool:
    return int(hashlib.md5(rel.encode()).hexdigest(), 16) % 100 < percent


def load_corpus(percent: int):
    root, files = stdlib_files()
    train, held = [], []
    for p in files:
        rel = p.relative_to(root).as_posix()
        text = p.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        (held if is_heldout(rel, percent) else train).append((rel, text))
    return root, train, held


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def wrap_tokenizer(tok, seq: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=seq,
    )


def encode_stream(tok, texts: list[str]):
    import torch

    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------- model
def make_config(args, layers: int, vocab: int, ids: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, args.long_seq),  # the longest trained window
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        attn_implementation="sdpa",
    )


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def lr_at(progress: float, base: float, warmup: float) -> float:
    if progress < warmup:
        return base * max(progress, 1e-3) / warmup
    t = (progress - warmup) / max(1e-9, 1 - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_optimizer(model, lr: float):
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )


def sample_batch(stream, batch: int, seq: int, gen):
    import torch

    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


def eval_windows(stream, seq: int, max_tokens: int):
    import torch

    n = min(max_tokens, stream.numel() - 1) // seq
    return [stream[i * seq : i * seq + seq + 1] for i in range(n)] if n else [stream[: stream.numel()]]


def quick_eval_loss(model, windows, limit: int = 16) -> float:
    import torch
    import torch.nn.functional as F

    model.eval()
    tot, cnt = 0.0, 0
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for w in windows[:limit]:
            logits = model(input_ids=w[None, :-1]).logits.float()
            tot += F.cross_entropy(logits[0], w[1:], reduction="sum").item()
            cnt += w.numel() - 1
    model.train()
    return tot / cnt


def run_phase(name, model, step_fn, steps, minutes, lr, args, gen, eval_fn):
    """Generic training loop: progress = max(step / steps, elapsed / time cap) drives the LR schedule and the stop."""
    import torch

    opt = make_optimizer(model, lr)
    model.train()
    cap = minutes * 60.0
    t0, c0 = time.perf_counter(), time.process_time()
    step, run_loss, run_n, tokens = 0, 0.0, 0, 0
    time_capped = False
    while True:
        elapsed = time.process_time() - c0  # CPU time: the cap means the same on a busy machine
        progress = max(step / steps, elapsed / cap)
        if progress >= 1.0:
            time_capped = step < steps
            break
        cur_lr = lr_at(progress, lr, warmup=0.05)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        if args.long_seq and args.long_every and step % args.long_every == args.long_every - 1:
            x = sample_batch(args.stream, max(1, args.batch * args.seq // args.long_seq), args.long_seq, gen)
        else:
            x = sample_batch(args.stream, args.batch, args.seq, gen)
        loss, extra = step_fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        step += 1
        tokens += x.numel() - x.shape[0]
        run_loss += loss.item()
        run_n += 1
        if step % args.log_every == 0 or step == 1:
            el, cpu = time.perf_counter() - t0, time.process_time() - c0
            log(
                f"[{name}] step {step:5d}/{steps} loss {run_loss / run_n:.4f}{extra} lr {cur_lr:.2e} "
                f"gnorm {gnorm:.2f} tokens {tokens / 1e6:.2f}M wall {el:6.1f}s cpu {cpu:6.1f}s ({tokens / cpu:.0f} tok/cpu-s)"
            )
            run_loss, run_n = 0.0, 0
        if args.eval_every and step % args.eval_every == 0:
            log(f"[{name}] step {step:5d} held-out {eval_fn()}")
    el, cpu = time.perf_counter() - t0, time.process_time() - c0
    note = f" (CPU-time cap of {minutes:g} min hit before {steps} steps)" if time_capped else ""
    log(f"[{name}] done: {step} steps, {tokens / 1e6:.2f}M tokens, wall {el:.1f}s, cpu {cpu:.1f}s{note}; "
        f"held-out {eval_fn()}")
    return {"steps": step, "tokens": tokens, "seconds": el, "cpu_seconds": cpu, "time_capped": time_capped}


# ----------------------------------------------------------------------------------------------------- evaluation
def full_eval(target, draft, windows):
    """Held-out loss of both and teacher-forced greedy agreement on real text (fp32)."""
    import torch
    import torch.nn.functional as F

    res = {"target_nll": 0.0, "draft_nll": 0.0, "agree": 0, "tokens": 0, "target_top1": 0, "draft_top1": 0}
    with torch.inference_mode():
        for w in windows:
            x, y = w[None, :-1], w[1:]
            tl = target(input_ids=x).logits[0].float()
            dl = draft(input_ids=x).logits[0].float()
            res["target_nll"] += F.cross_entropy(tl, y, reduction="sum").item()
            res["draft_nll"] += F.cross_entropy(dl, y, reduction="sum").item()
            ta, da = tl.argmax(-1), dl.argmax(-1)
            res["agree"] += (ta == da).sum().item()
            res["target_top1"] += (ta == y).sum().item()
            res["draft_top1"] += (da == y).sum().item()
            res["tokens"] += y.numel()
    n = res["tokens"]
    return {
        "tokens": n,
        "target_loss": res["target_nll"] / n,
        "draft_loss": res["draft_nll"] / n,
        "target_ppl": math.exp(res["target_nll"] / n),
        "draft_ppl": math.exp(res["draft_nll"] / n),
        "target_top1": res["target_top1"] / n,
        "draft_top1": res["draft_top1"] / n,
        "accept_real": res["agree"] / n,
    }


def simulate_speculative(match: list[bool], gamma: int) -> float:
    """Mean tokens emitted per target call when the draft proposes ``gamma`` greedy tokens and the target's greedy
    choice is the reference (``match[i]``: draft's token at position i equals the target's)."""
    i, emitted, calls = 0, 0, 0
    n = len(match)
    while i < n:
        k = 0
        while k < gamma and i + k < n and match[i + k]:
            k += 1
        step = min(k + 1, n - i)
        emitted += step
        calls += 1
        i += step
    return emitted / max(1, calls)


def greedy_continuation_eval(target, draft, held_stream, args, gen, eos_id):
    """Target generates greedily from held-out prompts; the draft is teacher-forced on that continuation."""
    import torch

    prompt_len = 64
    agree, total, per_tokens = 0, 0, []
    samples = []
    starts = torch.randint(0, held_stream.numel() - prompt_len - 1, (args.gen_prompts,), generator=gen).tolist()
    with torch.inference_mode():
        for s in starts:
            prompt = held_stream[s : s + prompt_len][None]
            out = target.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=args.gen_tokens,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=target.config.pad_token_id,
            )
            cont = out[0, prompt_len:]
            if (cont == eos_id).any():
                cont = cont[: int((cont == eos_id).nonzero()[0]) + 1]
            seq = out[:, : prompt_len + cont.numel()]
            dl = draft(input_ids=seq).logits[0, prompt_len - 1 : prompt_len - 1 + cont.numel()]
            m = (dl.argmax(-1) == cont).tolist()
            agree += sum(m)
            total += len(m)
            per_tokens.append(simulate_speculative(m, args.gamma))
            samples.append(out[0])
    return agree / max(1, total), total, statistics.mean(per_tokens), samples


def decode_time_ms(model, prompt, steps: int) -> list[float]:
    import torch

    from speculative_kernels.generation.capabilities import cache_argument

    times = []
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        arg = cache_argument(model)  # past_key_values, or cache from transformers 5.24
        pkv, tok = getattr(out, arg), out.logits[:, -1:].argmax(-1)
        for i in range(steps + 10):
            t = time.perf_counter()
            out = model(input_ids=tok, **{arg: pkv}, use_cache=True)
            dt = time.perf_counter() - t
            pkv, tok = getattr(out, arg), out.logits[:, -1:].argmax(-1)
            if i >= 10:
                times.append(dt * 1e3)
    return times


def dir_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


# ------------------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.threads > 1 else "false"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    t_start, c_start = time.perf_counter(), time.process_time()
    log(f"# train_demo_pair.py {' '.join(sys.argv[1:])}")
    log(
        f"# python {platform.python_version()} torch {torch.__version__} transformers {transformers.__version__} "
        f"threads {torch.get_num_threads()} seed {args.seed} machine {platform.machine()} {platform.processor()}"
    )

    # ---- data + tokenizer
    root, train, held = load_corpus(args.eval_percent)
    train_texts, held_texts = [t for _, t in train], [t for _, t in held]
    log(
        f"# stdlib {root}: {len(train)} training files ({sum(map(len, train_texts)) / 1e6:.2f}M chars), "
        f"{len(held)} held-out files ({sum(map(len, held_texts)) / 1e6:.2f}M chars)"
    )
    log(f"# held-out files: {' '.join(r for r, _ in held)}")
    t = time.perf_counter()
    tok = train_tokenizer(train_texts, args.vocab)
    vocab = tok.get_vocab_size()
    ids = {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS), "pad": tok.token_to_id(PAD)}
    stream = encode_stream(tok, train_texts)
    held_stream = encode_stream(tok, held_texts)
    log(
        f"# tokenizer: byte-level BPE vocab {vocab} {ids}; {stream.numel() / 1e6:.2f}M training tokens "
        f"({sum(map(len, train_texts)) / stream.numel():.2f} chars/token), {held_stream.numel() / 1e6:.3f}M held-out "
        f"tokens; {time.perf_counter() - t:.1f}s"
    )
    max_len = max(args.seq, args.long_seq)
    hf_tok = wrap_tokenizer(tok, max_len)
    args.stream = stream
    held_windows = eval_windows(held_stream, max_len, args.eval_tokens)
    gen = torch.Generator().manual_seed(args.seed)

    # ---- target
    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(make_config(args, args.target_layers, vocab, ids))
    log(f"# target: {args.target_layers} layers, hidden {args.hidden}, {n_params(target) / 1e6:.2f}M params")

    def target_step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = target(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
        return loss, ""

    def target_eval():
        return f"loss {quick_eval_loss(target, held_windows):.4f}"

    target_info = run_phase(
        "target", target, target_step, args.target_steps, args.target_minutes, args.target_lr, args, gen, target_eval
    )
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    # ---- draft: initialise from the target's embeddings / first layers / final norm, then distil
    torch.manual_seed(args.seed + 1)
    draft = LlamaForCausalLM(make_config(args, args.draft_layers, vocab, ids))
    missing = draft.load_state_dict(
        {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")
         or int(k.split(".")[2]) < args.draft_layers},
        strict=False,
    )
    assert not missing.missing_keys or missing.missing_keys == ["lm_head.weight"], missing
    draft.tie_weights()
    log(f"# draft: {args.draft_layers} layers, hidden {args.hidden}, {n_params(draft) / 1e6:.2f}M params "
        f"(initialised from target layers 0..{args.draft_layers - 1})")
    a = args.ce_weight

    def draft_step(x):
        inp = x[:, :-1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                tl = target(input_ids=inp).logits
            dl = draft(input_ids=inp).logits
        tlog = F.log_softmax(tl.float().reshape(-1, vocab), -1)
        dlog = F.log_softmax(dl.float().reshape(-1, vocab), -1)
        kl = (tlog.exp() * (tlog - dlog)).sum(-1).mean()
        ce = F.nll_loss(dlog, x[:, 1:].reshape(-1))
        with torch.no_grad():
            agree = (tlog.argmax(-1) == dlog.argmax(-1)).float().mean().item()
        return (1 - a) * kl + a * ce, f" (kl {kl.item():.4f} ce {ce.item():.4f} agree {agree:.3f})"

    def draft_eval():
        return f"loss {quick_eval_loss(draft, held_windows):.4f}"

    draft_info = run_phase(
        "draft", draft, draft_step, args.draft_steps, args.draft_minutes, args.draft_lr, args, gen, draft_eval
    )
    train_seconds, train_cpu = time.perf_counter() - t_start, time.process_time() - c_start

    # ---- export (fp16 safetensors + tokenizer + generation config)
    out = args.out.resolve()
    gen_cfg = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], do_sample=False
    )
    dirs = {}
    for name, model in (("target", target), ("draft", draft)):
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        for f in d.iterdir():
            if f.is_file():
                f.unlink()
        model.generation_config = gen_cfg
        model.half().save_pretrained(d)
        hf_tok.save_pretrained(d)
        dirs[name] = d
    del target, draft
    log(f"# saved to {out} ({time.perf_counter() - t_start:.1f}s since start)")

    # ---- reload from disk (fp32) and evaluate
    tgt = AutoModelForCausalLM.from_pretrained(dirs["target"], dtype=torch.float32).eval()
    dft = AutoModelForCausalLM.from_pretrained(dirs["draft"], dtype=torch.float32).eval()
    tok_t = AutoTokenizer.from_pretrained(dirs["target"])
    tok_d = AutoTokenizer.from_pretrained(dirs["draft"])
    snippet = "def add(a, b):\n    return a + b  # sum\n\n\tprint('héllo')\n"
    assert tok_t.get_vocab() == tok_d.get_vocab() and len(tok_t) == tgt.config.vocab_size == dft.config.vocab_size
    assert tok_t.decode(tok_t(snippet)["input_ids"], skip_special_tokens=True) == snippet

    ev = full_eval(tgt, dft, held_windows)
    acc_gen, gen_total, tok_per_call, samples = greedy_continuation_eval(
        tgt, dft, held_stream, args, torch.Generator().manual_seed(args.seed + 2), ids["eos"]
    )
    prompt = held_stream[:64][None]
    tt, dt = [], []
    for _ in range(3):  # interleave rounds so both see the same machine load
        tt += decode_time_ms(tgt, prompt, args.timing_steps)
        dt += decode_time_ms(dft, prompt, args.timing_steps)
    t_ms, d_ms = statistics.median(tt), statistics.median(dt)
    c = d_ms / t_ms
    total_seconds, total_cpu = time.perf_counter() - t_start, time.process_time() - c_start

    res = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seed": args.seed,
        "train_files": len(train),
        "heldout_files": len(held),
        "train_tokens_corpus": stream.numel(),
        "heldout_tokens_corpus": held_stream.numel(),
        "vocab": vocab,
        "target_params": n_params(tgt),
        "draft_params": n_params(dft),
        "target_layers": tgt.config.num_hidden_layers,
        "draft_layers": dft.config.num_hidden_layers,
        "target_bytes": dir_size(dirs["target"]),
        "draft_bytes": dir_size(dirs["draft"]),
        "target_weights_bytes": (dirs["target"] / "model.safetensors").stat().st_size,
        "draft_weights_bytes": (dirs["draft"] / "model.safetensors").stat().st_size,
        "target_train": target_info,
        "draft_train": draft_info,
        **ev,
        "accept_greedy": acc_gen,
        "accept_greedy_tokens": gen_total,
        "tokens_per_target_call": tok_per_call,
        "target_decode_ms": t_ms,
        "draft_decode_ms": d_ms,
        "c": c,
        "train_seconds": train_seconds,
        "total_seconds": total_seconds,
        "train_cpu_seconds": train_cpu,
        "total_cpu_seconds": total_cpu,
        "max_len": max_len,
    }
    g = args.gamma
    res["est_speedup"] = tok_per_call / (g * c + 1)
    log("# ---------------------------------------------------------------- results")
    log(f"params: target {res['target_params'] / 1e6:.2f}M ({res['target_layers']} layers), "
        f"draft {res['draft_params'] / 1e6:.2f}M ({res['draft_layers']} layers)")
    log(f"files: target {res['target_bytes'] / 1e6:.2f} MB (weights {res['target_weights_bytes'] / 1e6:.2f} MB), "
        f"draft {res['draft_bytes'] / 1e6:.2f} MB (weights {res['draft_weights_bytes'] / 1e6:.2f} MB), "
        f"total {(res['target_bytes'] + res['draft_bytes']) / 1e6:.2f} MB")
    log(f"decode (batch 1, KV cache, fp32, 1 thread, median of {len(tt)}): target {t_ms:.3f} ms/token, "
        f"draft {d_ms:.3f} ms/token, c = {c:.3f}")
    log(f"held-out ({ev['tokens']} tokens): target loss {ev['target_loss']:.4f} (ppl {ev['target_ppl']:.2f}, "
        f"top-1 {ev['target_top1']:.3f}), draft loss {ev['draft_loss']:.4f} (ppl {ev['draft_ppl']:.2f}, "
        f"top-1 {ev['draft_top1']:.3f})")
    log(f"greedy acceptance: teacher-forced on held-out text {ev['accept_real']:.3f}; on the target's greedy "
        f"continuations ({gen_total} tokens from {args.gen_prompts} held-out prompts) {acc_gen:.3f}")
    log(f"simulated greedy speculative decoding, gamma={g}: {tok_per_call:.2f} tokens per target call, "
        f"rough speedup {tok_per_call:.2f} / ({g} * c + 1) = {res['est_speedup']:.2f}x")
    log(f"time: training {train_seconds / 60:.1f} min wall ({train_cpu / 60:.1f} min CPU), total incl. export+eval "
        f"{total_seconds / 60:.1f} min wall ({total_cpu / 60:.1f} min CPU)")
    log("sample (target greedy continuation of a held-out prompt; prompt | continuation):")
    s0 = samples[0]
    log(tok_t.decode(s0[:64]) + "|" + tok_t.decode(s0[64:]))
    log("# results json: " + json.dumps(res, default=str))
    write_readme(out, args, res, root)
    log(f"# wrote {out / 'README.md'}")
    return 0


def write_readme(out: Path, args, r: dict, root: Path) -> None:
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    text = f"""# Demo target/draft pair

A small Llama-style **target** model and a much shallower **draft** model that share one tokenizer, shipped so that
speculative decoding can be demonstrated offline on any machine (CPU included). They are toy models trained for a few
minutes on Python source code: they write plausible-looking Python, not correct programs.

Load them with `speculative_kernels.demo_pair.demo_model_paths()`, which returns `(target_dir, draft_dir)`:

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from speculative_kernels.demo_pair import demo_model_paths

target_dir, draft_dir = demo_model_paths()
tok = AutoTokenizer.from_pretrained(target_dir)            # identical tokenizer in both folders
target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
```

The weights are stored as fp16; without `dtype=` transformers 5 loads them as fp16 (`dtype="auto"`), which is slow
on CPU, so pass `dtype=torch.float32` on CPU (or fp16/bf16 on GPU).

## How they were made

`benchmarks/train_demo_pair.py` (log: `benchmarks/demo_pair_training.log`), on one CPU core, seed {r['seed']},
Python {r['python']}, torch {r['torch']}, transformers {r['transformers']}:

* **Text:** the `*.py` files of the Python {r['python']} standard library of the interpreter that ran the script
  (`sysconfig.get_paths()["stdlib"]`), without test folders, `site-packages`, `encodings/`, `pydoc_data/` and
  `_sysconfigdata*`. {r['heldout_files']} files (those whose relative path's MD5 is 0..{args.eval_percent - 1} mod 100)
  are held out for evaluation; {r['train_files']} files ({r['train_tokens_corpus'] / 1e6:.2f}M tokens) are for training.
* **Tokenizer:** byte-level BPE (`tokenizers`), vocabulary {r['vocab']}, special tokens `<|bos|>`=0, `<|eos|>`=1,
  `<|pad|>`=2; encoding prepends `<|bos|>`; lossless round trip. Saved as `PreTrainedTokenizerFast`.
* **Target:** `LlamaForCausalLM`, {r['target_layers']} layers, hidden {args.hidden}, MLP {args.intermediate},
  {args.heads} heads, tied embeddings; next-token loss on random {args.seq}-token windows, batch {args.batch}
  (every {args.long_every}th step: {max(1, args.batch * args.seq // args.long_seq) if args.long_seq else 0} windows of
  {args.long_seq} tokens),
  AdamW (lr {args.target_lr:g}, warm-up + cosine), bf16 autocast; {r['target_train']['steps']} steps
  ({r['target_train']['tokens'] / 1e6:.2f}M tokens, {r['target_train']['seconds'] / 60:.1f} min).
* **Draft:** same architecture with {r['draft_layers']} layer(s), initialised from the target's embeddings, first
  layer(s) and final norm, then distilled from the target with loss {1 - args.ce_weight:g} * KL(target || draft) +
  {args.ce_weight:g} * next-token CE; {r['draft_train']['steps']} steps ({r['draft_train']['tokens'] / 1e6:.2f}M tokens,
  {r['draft_train']['seconds'] / 60:.1f} min).
* Saved as fp16 safetensors; `generation_config.json` is greedy (no `do_sample`) and leaves the length to the caller;
  `max_position_embeddings` is {r['max_len']}, the longest training window (positions beyond it were never trained).

Time: {r['train_seconds'] / 60:.1f} min wall-clock ({r['train_cpu_seconds'] / 60:.1f} min of CPU time on one thread)
for tokenizer + training, {r['total_seconds'] / 60:.1f} min wall-clock ({r['total_cpu_seconds'] / 60:.1f} min CPU)
including export and evaluation; the machine's other core was busy with other work during the run.

## Measured (reloaded from the saved files, fp32, one CPU thread)

| | target | draft |
|---|---|---|
| layers | {r['target_layers']} | {r['draft_layers']} |
| parameters | {r['target_params'] / 1e6:.2f}M | {r['draft_params'] / 1e6:.2f}M |
| folder size | {mb(r['target_bytes'])} | {mb(r['draft_bytes'])} |
| held-out loss (nats/token) | {r['target_loss']:.3f} | {r['draft_loss']:.3f} |
| held-out perplexity | {r['target_ppl']:.2f} | {r['draft_ppl']:.2f} |
| held-out top-1 accuracy | {r['target_top1']:.3f} | {r['draft_top1']:.3f} |
| decode time per token (batch 1, KV cache, median) | {r['target_decode_ms']:.3f} ms | {r['draft_decode_ms']:.3f} ms |

* **Cost ratio** c = draft / target time per token = **{r['c']:.3f}**.
* **Greedy acceptance** (draft's argmax equals the target's argmax for the same prefix), held-out files:
  **{r['accept_real']:.3f}** teacher-forced on the real text ({r['tokens']} tokens); **{r['accept_greedy']:.3f}** on
  the target's own greedy continuations ({r['accept_greedy_tokens']} tokens from {args.gen_prompts} held-out
  prompts).
* Simulated greedy speculative decoding with {args.gamma} draft tokens on those continuations:
  {r['tokens_per_target_call']:.2f} tokens per target call, i.e. a rough speed-up of
  {r['tokens_per_target_call']:.2f} / ({args.gamma} c + 1) = {r['est_speedup']:.2f}x if verifying {args.gamma + 1}
  tokens costs about one decode step (on CPU it costs somewhat more).

Timings depend on the machine and its load; rerun the script's evaluation to measure yours.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
