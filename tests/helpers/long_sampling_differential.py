"""A long-horizon sampling differential: ``speculative_kernels.generate`` against ``model.generate``'s own samples.

``sampling_differential`` enumerates HF's chain exactly, which bounds it to NEW = 3 tokens (one or two iterations).
Here each random case generates ``--new-tokens`` tokens (many iterations: rollbacks, ``num_speculative_tokens="auto"``
choosing its gamma, rows finishing on EOS and leaving the batch, a static cache filling, processors over
long contexts) for three prompts of different lengths (left-padded), ``--rows`` rows each, with random processor,
warper and EOS settings, a draft model, the early-exit draft, prompt lookup or the n-gram drafter, the dynamic or
static cache, ``num_return_sequences``, ``seed=``, and the settings in the call or as the model's generation_config
defaults (a checkpoint with ``do_sample=True``). Per prompt, the per-position token marginals and three
adjacent-pair joints of our rows and of ``model.generate``'s are compared by two-sample chi-square (cells pooled
below 5 expected); a case alarms ("!!!") when its smallest p-value times the number of tests (Bonferroni) is below
1e-3: about one false alarm per thousand cases. Rerun an alarm with another ``--rows`` before believing it.
``--mutate-temperature 1.1`` runs ours 10% hotter than HF's (the power check: most cases then alarm).
``--dtype``/``--draft-dtype`` run the target (and ``model.generate``) and the draft in bfloat16 or float16, the same
or mixed; ``--autocast`` runs both sides under CPU bfloat16 autocast. The models keep SDPA attention, whose
multi-token forwards round differently from one-token steps in half precision (``docs/half_precision.md``): a
difference found here may be the model's rounding; ``half_sampling_differential`` tests without it, exactly.
``--compile BACKEND`` runs ours with ``compile=CompileOptions(backend=BACKEND)`` (``inductor``: ``compile=True``'s
CPU default), on the static cache with a fixed gamma (what compile takes; "auto" draws become 4): draws 0-7 with
inductor (2026-11-28; 4500 rows a side, 16 tokens, 57 tests each; 56-708 s a case on 2 loaded cores) raised no alarm.

    cd tests && python -m helpers.long_sampling_differential 0 30 [--rows 1500] [--new-tokens 16] [--auto]
        [--dtype bfloat16] [--draft-dtype float32] [--autocast] [--compile inductor]
"""

import argparse
import contextlib
import copy
import random
import sys
import time
import warnings

import numpy as np
import torch
from scipy import stats

import speculative_kernels as sk
from helpers.models import llama, perturbed

VOCAB = 8
EOS = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALARM = 1e-3
PROMPTS = [[1, 4, 3, 5, 7], [6, 2, 4], [5]]
# Each setting's values, its default repeated so that most cases leave it off (as sampling_differential's).
SETTINGS = dict(
    temperature=[1.0, 0.7, 1.4], top_k=[0, 0, 3, 5], top_p=[1.0, 1.0, 0.8, 0.6], min_p=[None, None, 0.1, 0.2],
    typical_p=[1.0, 1.0, 0.7], epsilon_cutoff=[0.0, 0.0, 0.05], eta_cutoff=[0.0, 0.0, 0.05],
    repetition_penalty=[1.0, 1.0, 1.5, 0.8], no_repeat_ngram_size=[0, 0, 0, 3], suppress_tokens=[None, None, [3]],
    begin_suppress_tokens=[None, None, [1]], sequence_bias=[None, None, {(2,): 1.0}, {(1, 3): -3.0}],
    bad_words_ids=[None, None, [[4]], [[5, 6]]], renormalize_logits=[False, True],
)
EOS_SETTINGS = dict(min_new_tokens=[None, None, 3], exponential_decay_length_penalty=[None, None, (4, 1.2)])


def models():
    """(target, draft): a 3-layer Llama over VOCAB tokens with spread-out next-token distributions and no EOS by
    default, and a noisy copy of it."""
    target = llama(layers=3, vocab=VOCAB, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.generation_config.eos_token_id = None
    return target, perturbed(target, 0.3)


def random_case(seed: int, auto: bool = False, compile: str | None = None) -> dict:
    """A case's settings and drafting; auto: a draft model or the early-exit draft with gamma "auto" (the dynamic
    cache: the static one refuses "auto"); compile: a torch.compile backend (the static cache, a fixed gamma)."""
    rng = random.Random(seed)
    settings = {k: rng.choice(v) for k, v in SETTINGS.items()}
    eos = rng.random() < 0.5
    if eos:
        settings.update({k: rng.choice(v) for k, v in EOS_SETTINGS.items()})
    drafting = rng.choice(["draft_model", "draft_model", "prompt_lookup", "ngram", "early_exit"])
    gamma = rng.choice([1, 2, 4, 6, "auto"]) if drafting in ("draft_model", "early_exit") else rng.choice([2, 4])
    cache = rng.choice(["dynamic", "dynamic", "static"])
    if cache == "static" and gamma == "auto":
        gamma = 4
    if auto:
        drafting, gamma, cache = ("draft_model", "early_exit")[seed % 2], "auto", "dynamic"
    if compile:
        cache, gamma = "static", 4 if gamma == "auto" else gamma
    return dict(seed=seed, eos=eos, drafting=drafting, gamma=gamma, cache=cache, compile=compile,
                returns=rng.choice([1, 1, 3]), seeded=rng.random() < 0.5, defaults=rng.random() < 0.3,
                settings={k: v for k, v in settings.items() if v is not None})


def prompts(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPTS left-padded, each repeated ``rows`` times: (ids [3 rows, W], mask [3 rows, W])."""
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids.repeat_interleave(rows, 0), mask.repeat_interleave(rows, 0)


def two_sample(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square p-value of the category counts a and b (the same cells); cells where either sample
    expects fewer than 5 are pooled."""
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    share = a.sum() / (a.sum() + b.sum())
    big = np.minimum((a + b) * share, (a + b) * (1 - share)) >= 5
    rows_a, rows_b = list(a[big]), list(b[big])
    if (~big).any():
        rows_a.append(a[~big].sum())
        rows_b.append(b[~big].sum())
    if len(rows_a) < 2:
        return 1.0
    return stats.chi2_contingency(np.array([rows_a, rows_b]), correction=False).pvalue


def sample_both(case: dict, target, draft, rows: int, new: int, mutate: float = 1.0):
    """(ours, HF's): [3 rows, new] int64 numpy arrays of new tokens (pad id 0 after a row's end)."""
    ids, mask = prompts(rows // case["returns"])
    settings = dict(case["settings"], **({"eos_token_id": EOS} if case["eos"] else {}))
    call = dict(max_new_tokens=new, pad_token_id=0, num_return_sequences=case["returns"])
    target = copy.deepcopy(target)
    if case["defaults"]:  # a checkpoint's defaults: do_sample and the settings in its generation_config
        for name, value in {**settings, "do_sample": True}.items():
            setattr(target.generation_config, name, value)
    else:
        call.update(settings, do_sample=True)
    drafting = {"draft_model": dict(draft_model=draft, num_speculative_tokens=case["gamma"]),
                "early_exit": dict(assistant_early_exit=1, num_speculative_tokens=case["gamma"]),
                "prompt_lookup": dict(prompt_lookup_num_tokens=case["gamma"]),
                "ngram": dict(drafter=sk.NGramDrafter(VOCAB))}[case["drafting"]]
    if case["cache"] == "static":
        drafting["cache_implementation"] = "static"
    if case.get("compile"):
        drafting["compile"] = sk.CompileOptions(backend=case["compile"])
    ours_call = dict(call)
    if mutate != 1.0:
        ours_call["temperature"] = settings.get("temperature", 1.0) * mutate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(case["seed"])
        ours = sk.generate(target, ids, attention_mask=mask, seed=case["seed"] if case["seeded"] else None,
                           **ours_call, **drafting)
        torch.manual_seed(case["seed"] + 10**6)
        theirs = target.generate(ids, attention_mask=mask, **call)
    width = ids.shape[1]
    return tuple(torch.nn.functional.pad(out, (0, width + new - out.shape[1]))[:, width:].numpy()
                 for out in (ours, theirs))


def check_case(case: dict, target, draft, rows: int, new: int, mutate: float = 1.0) -> tuple[float, int]:
    """(the smallest p-value, the number of tests) of one case."""
    ours, theirs = sample_both(case, target, draft, rows, new, mutate)
    per = rows // case["returns"] * case["returns"]
    p_values = []
    for g in range(len(PROMPTS)):
        a, b = ours[g * per : (g + 1) * per], theirs[g * per : (g + 1) * per]
        for t in range(new):
            p_values.append(two_sample(np.bincount(a[:, t], minlength=VOCAB), np.bincount(b[:, t], minlength=VOCAB)))
        for t in sorted({0, new // 2, new - 2} & set(range(new - 1))):
            pairs_a, pairs_b = a[:, t] * VOCAB + a[:, t + 1], b[:, t] * VOCAB + b[:, t + 1]
            p_values.append(two_sample(np.bincount(pairs_a, minlength=VOCAB**2),
                                       np.bincount(pairs_b, minlength=VOCAB**2)))
    return min(p_values), len(p_values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=int, help="first seed (inclusive)")
    parser.add_argument("last", type=int, help="last seed (exclusive)")
    parser.add_argument("--rows", type=int, default=1500, help="rows per prompt and side")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--auto", action="store_true", help='every case drafts with num_speculative_tokens="auto"')
    parser.add_argument("--mutate-temperature", type=float, default=1.0, help="ours at this times HF's temperature")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the target's dtype")
    parser.add_argument("--draft-dtype", choices=sorted(DTYPES), help="the draft's dtype (default: the target's)")
    parser.add_argument("--autocast", action="store_true", help="both sides under CPU bfloat16 autocast")
    parser.add_argument("--compile", default=None, help="a torch.compile backend: compile=CompileOptions(backend=...)")
    args = parser.parse_args(argv)
    target, draft = models()
    target, draft = target.to(DTYPES[args.dtype]), draft.to(DTYPES[args.draft_dtype or args.dtype])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
    alarms = 0
    for seed in range(args.first, args.last):
        case = random_case(seed, args.auto, args.compile)
        start = time.time()
        try:
            with autocast:
                p_min, tests = check_case(case, target, draft, args.rows, args.new_tokens, args.mutate_temperature)
            alarm = p_min * tests < ALARM
            alarms += alarm
            verdict = f"{'!!!' if alarm else 'ok '} min p={p_min:.2g} x {tests} tests"
        except ValueError as error:  # a refusal by name
            verdict = "refused: " + str(error)[:200].replace("\n", " ")
        print(f"{verdict} ({time.time() - start:.0f} s)  {case}", flush=True)
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
