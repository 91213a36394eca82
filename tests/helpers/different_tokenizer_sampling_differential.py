"""Sampling differential for a draft with another tokenizer: sk (generate / session / continuous batch) vs
model.generate's own samples, per-position marginals + adjacent-pair joints, two-sample chi-square (the machinery of
tests/helpers/long_sampling_differential.py).

    cd tests && OMP_NUM_THREADS=1 python -m helpers.different_tokenizer_sampling_differential FIRST LAST [--rows R]
        [--new N] [--mode usd|text|session|decoder|any] [--mutate-temperature 1.1]

2026-11-28 (CPU, transformers 5.24): seeds 3..125 at 1200 rows (decoder mode 400), 12 new tokens: 123 cases, no
alarm (smallest p x tests 0.045); --mutate-temperature 1.1 on seeds 1000..1007: 7 of 8 alarm.
"""
import argparse
import random
import time
import warnings

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models as tmodels
from transformers import PreTrainedTokenizerFast

import speculative_kernels as sk
from helpers.long_sampling_differential import ALARM, EOS, EOS_SETTINGS, PROMPTS, SETTINGS, VOCAB, prompts, two_sample
from helpers.models import llama, perturbed
from helpers.tiny_tokenizers import char_tokenizer, permutation, permuted, permuted_model

CHARS = "abcdefgh"  # the target's 8 ids (VOCAB); EOS = 2 ("c"), pad 0 ("a")


def merged_tokenizer():
    """A draft tokenizer sharing a..e with the target, lacking f, g, h (dropped from its text), with merges."""
    vocab = {c: i for i, c in enumerate(["b", "a", "d", "c", "e", "x", "ab", "cd", "ba", "ee"])}
    t = Tokenizer(tmodels.BPE(vocab=vocab, merges=[("a", "b"), ("c", "d"), ("b", "a"), ("e", "e")]))
    t.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t)


def build():
    target = llama(layers=3, vocab=VOCAB, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.generation_config.eos_token_id = None
    tok = char_tokenizer(CHARS)
    perm = permutation(VOCAB, seed=3)
    ptok = permuted(tok, perm, extra=("X",))
    drafts = {
        "perm": (permuted_model(target, perm, extra=1), ptok),
        "noisy_perm": (permuted_model(perturbed(target, 0.3), perm, extra=1), ptok),
        "merged": (llama(layers=1, vocab=10, seed=7), merged_tokenizer()),
    }
    # a target tokenizer with one id ("q") past the target's head, which this draft favours
    qdraft = llama(layers=1, vocab=9, seed=8)
    with torch.no_grad():
        qdraft.lm_head.weight.mul_(4.0)
        qdraft.lm_head.weight[0] = qdraft.lm_head.weight[1:].mean(0) * 0 + qdraft.lm_head.weight[1:].abs().mean() * 0
        qdraft.lm_head.weight[0] = qdraft.lm_head.weight[1:].sum(0)
    drafts["qdraft"] = (qdraft, char_tokenizer("q" + CHARS))
    with torch.no_grad():
        drafts["merged"][0].lm_head.weight.mul_(4.0)
    return target, tok, drafts


WIDE_TARGET_TOK = char_tokenizer(CHARS + "q")  # ("q": id 8, past the target's 8-id head)


def random_case(seed, mode):
    rng = random.Random(seed)
    settings = {k: rng.choice(v) for k, v in SETTINGS.items()}
    eos = rng.random() < 0.5
    if eos:
        settings.update({k: rng.choice(v) for k, v in EOS_SETTINGS.items()})
    if mode == "any":
        mode = rng.choice(["usd", "usd", "usd", "text", "text", "session", "decoder"])
    return dict(seed=seed, mode=mode, eos=eos, draft=rng.choice(["perm", "noisy_perm", "merged", "merged", "qdraft"]),
                gamma=rng.choice([1, 2, 3, 5]), lookbehind=rng.choice([None, (0, 0), (1, 2), (3, 0)]),
                chunk=rng.choice([None, None, 1, 2]),
                settings={k: v for k, v in settings.items() if v is not None})


def ours(case, target, tok, draft, dtok, ids, mask, call, mutate):
    mode = case["mode"]
    call = dict(call)
    if mutate != 1.0:
        call["temperature"] = call.get("temperature", 1.0) * mutate
    extra = {}
    if case["lookbehind"] is not None:
        extra = dict(target_lookbehind=case["lookbehind"][0], assistant_lookbehind=case["lookbehind"][1])
    if case["chunk"] is not None:
        extra["prefill_chunk_size"] = case["chunk"]
    if mode in ("usd", "text"):
        from speculative_kernels.generation import request
        from speculative_kernels.generation.retokenizing_drafter import MappedVocabularyDrafter, RetokenizingDrafter
        saved = request.MappedVocabularyDrafter
        if mode == "text":
            request.MappedVocabularyDrafter = (lambda runner, pair, vocabulary, width, dtype, device, **kw:
                                               RetokenizingDrafter(runner, pair, device, **kw))
        try:
            return sk.generate(target, ids, attention_mask=mask, assistant_model=draft, tokenizer=tok,
                               assistant_tokenizer=dtok, num_speculative_tokens=case["gamma"], seed=case["seed"],
                               **call, **extra)
        finally:
            request.MappedVocabularyDrafter = saved
    decoder = sk.SpeculativeDecoder(target, draft, tokenizer=tok, assistant_tokenizer=dtok,
                                    num_speculative_tokens=case["gamma"], max_batch_size=512)
    if mode == "session":
        session = decoder.start(ids, attention_mask=mask, seed=case["seed"], **call, **extra)
        while not session.finished:
            session.step()
        return session.sequences()
    # decoder: every row its own request, joining in three waves
    call.pop("num_return_sequences", None)
    call.pop("pad_token_id", None)
    if "prefill_chunk_size" in extra:
        call["prefill_chunk_size"] = extra["prefill_chunk_size"]
    rows = [[t for t, m in zip(r, mm) if m] for r, mm in zip(ids.tolist(), mask.tolist())]
    order = list(range(len(rows)))
    random.Random(case["seed"]).shuffle(order)
    waves = {0: order[: len(order) // 3], 2: order[len(order) // 3: 2 * len(order) // 3],
             3: order[2 * len(order) // 3:]}
    ids_of, streamed, step = {}, {}, 0
    while step <= 3 or decoder.has_work():
        for b in waves.get(step, []):
            ids_of[decoder.add_request(rows[b], seed=case["seed"] * 100003 + b, **call)] = b
        for rid, tokens in decoder.step().items():
            streamed.setdefault(rid, []).extend(tokens)
        step += 1
    new = call["max_new_tokens"]
    out = torch.zeros(len(rows), ids.shape[1] + new, dtype=torch.int64)
    for rid, b in ids_of.items():
        got = decoder.result(rid).token_ids
        assert got == streamed.get(rid, []), (got, streamed.get(rid))
        out[b, ids.shape[1]: ids.shape[1] + len(got)] = torch.tensor(got, dtype=torch.int64)
    return out


def check(case, target, tok, drafts, rows, new, mutate):
    draft, dtok = drafts[case["draft"]]
    if case["draft"] == "qdraft":
        tok = WIDE_TARGET_TOK
    settings = dict(case["settings"], **({"eos_token_id": EOS} if case["eos"] else {}))
    if case["mode"] == "decoder":  # (num_return_sequences is generate's; add_request's keywords only)
        from speculative_kernels.continuous import REQUEST_KEYWORDS
        settings = {k: v for k, v in settings.items() if k in REQUEST_KEYWORDS}
        returns = 1
    else:
        returns = random.Random(case["seed"] + 7).choice([1, 1, 3])
    if case["mode"] == "decoder":  # (a request per row: slow on the host; fewer rows)
        rows = rows // 3
    ids, mask = prompts(rows // returns)
    call = dict(max_new_tokens=new, pad_token_id=0, do_sample=True, **settings)
    if returns > 1:
        call["num_return_sequences"] = returns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(case["seed"])
        a = ours(case, target, tok, draft, dtok, ids, mask, call, mutate)
        torch.manual_seed(case["seed"] + 10**6)
        b = target.generate(ids, attention_mask=mask, **call)
    width = ids.shape[1]
    a, b = (torch.nn.functional.pad(o, (0, width + new - o.shape[1]))[:, width:].numpy() for o in (a, b))
    per = rows // returns * returns
    ps = []
    for g in range(len(PROMPTS)):
        x, y = a[g * per:(g + 1) * per], b[g * per:(g + 1) * per]
        for t in range(new):
            ps.append(two_sample(np.bincount(x[:, t], minlength=VOCAB), np.bincount(y[:, t], minlength=VOCAB)))
        for t in sorted({0, new // 2, new - 2} & set(range(new - 1))):
            ps.append(two_sample(np.bincount(x[:, t] * VOCAB + x[:, t + 1], minlength=VOCAB ** 2),
                                 np.bincount(y[:, t] * VOCAB + y[:, t + 1], minlength=VOCAB ** 2)))
    return min(ps), len(ps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("first", type=int)
    p.add_argument("last", type=int)
    p.add_argument("--rows", type=int, default=1200)
    p.add_argument("--new", type=int, default=12)
    p.add_argument("--mode", default="any")
    p.add_argument("--mutate-temperature", type=float, default=1.0)
    args = p.parse_args()
    target, tok, drafts = build()
    alarms = 0
    smallest = 1.0
    for seed in range(args.first, args.last):
        case = random_case(seed, args.mode)
        start = time.time()
        try:
            pmin, n = check(case, target, tok, drafts, args.rows, args.new, args.mutate_temperature)
            alarm = pmin * n < ALARM
            alarms += alarm
            smallest = min(smallest, pmin * n)
            verdict = f"{'!!!' if alarm else 'ok '} min p={pmin:.2g} x {n} tests"
        except ValueError as e:
            verdict = "refused: " + str(e)[:300].replace("\n", " ")
        except Exception as e:
            verdict = f"ERROR {type(e).__name__}: " + str(e)[:300].replace("\n", " ")
        print(f"{verdict} ({time.time() - start:.0f} s) {case}", flush=True)
    print(f"done {args.first}..{args.last}: alarms={alarms} smallest Bonferroni p={smallest:.3g}", flush=True)


if __name__ == "__main__":
    main()
