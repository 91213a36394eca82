"""A randomized sampling differential check: random processor, warper and EOS settings, drafted by a draft model,
prompt lookup or the n-gram drafter, on two prompts (one left-padded) of a tiny model over VOCAB tokens; each
prompt's whole continuations against the exact distribution of HF's own chain for that row (chi-square).

    cd tests && python -m helpers.sampling_differential 0 80   # seeds [0, 80): a line per case, "!!!" on a mismatch
"""

import copy
import random
import sys
import warnings

import numpy as np
import torch
from transformers import GenerationConfig

import speculative_kernels as sk
from helpers.models import llama, perturbed
from helpers.sampling import NEW, VOCAB, hf_chain_probs
from helpers.stats import assert_matches

EOS = 2
# Each setting's values, its default repeated so that most cases leave it off.
SETTINGS = dict(
    temperature=[1.0, 0.7, 1.4], top_k=[0, 0, 2, 4], top_p=[1.0, 1.0, 0.8, 0.6], min_p=[None, None, 0.1, 0.3],
    typical_p=[1.0, 1.0, 0.7], epsilon_cutoff=[0.0, 0.0, 0.05], eta_cutoff=[0.0, 0.0, 0.05],
    repetition_penalty=[1.0, 1.0, 1.5, 0.8], no_repeat_ngram_size=[0, 0, 2], suppress_tokens=[None, None, [3]],
    begin_suppress_tokens=[None, None, [1]], sequence_bias=[None, None, {(2,): 2.0}, {(1, 3): -3.0}],
    bad_words_ids=[None, None, [[4]], [[2, 5]]], renormalize_logits=[False, True],
    encoder_repetition_penalty=[1.0, 1.0, 1.3],
)
if hasattr(GenerationConfig(), "top_h"):  # (transformers >= 5.x's top-H warper)
    SETTINGS["top_h"] = [None, None, None, 0.6]
EOS_SETTINGS = dict(min_new_tokens=[None, 1, 2], exponential_decay_length_penalty=[None, (1, 1.5)],
                    forced_eos_token_id=[None, EOS], min_length=[None, 6])
PROMPTS = (torch.tensor([[1, 4, 3, 5]]), torch.tensor([[0, 4, 4, 2]]))
MASKS = (torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 1]]))


def models():
    """(target, draft): a Llama over VOCAB tokens with spread-out outputs (its LM head scaled so that no single
    continuation dominates), and a noisy copy of it as the draft."""
    target = llama(layers=2, vocab=VOCAB, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.generation_config.eos_token_id = None
    return target, perturbed(target, 0.3)


def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    settings = {k: rng.choice(v) for k, v in SETTINGS.items()}
    eos = EOS if rng.random() < 0.5 else None
    if eos is not None:
        settings.update({k: rng.choice(v) for k, v in EOS_SETTINGS.items()})
    drafting = rng.choice(["draft_model", "prompt_lookup", "ngram"])
    gamma = rng.choice([1, 2, 3]) if drafting == "draft_model" else rng.choice([2, 3])
    return dict(seed=seed, eos=eos, drafting=drafting, gamma=gamma,
                settings={k: v for k, v in settings.items() if v is not None})


def check_case(case: dict, target, draft, rows: int = 1500) -> list[float]:
    """The chi-square p-value of each prompt's continuations (rows of each); AssertionError on a mismatch."""
    config = GenerationConfig(do_sample=True, max_new_tokens=NEW, pad_token_id=0, eos_token_id=case["eos"],
                              **case["settings"])
    extra = {"draft_model": dict(draft_model=draft, num_speculative_tokens=case["gamma"]),
             "prompt_lookup": dict(prompt_lookup_num_tokens=case["gamma"]),
             "ngram": dict(drafter=sk.NGramDrafter(VOCAB))}[case["drafting"]]
    torch.manual_seed(case["seed"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = sk.generate(target, torch.cat([p.expand(rows, -1) for p in PROMPTS]),
                          attention_mask=torch.cat([m.expand(rows, -1) for m in MASKS]),
                          generation_config=copy.deepcopy(config), **extra)
    p_values = []
    for i, (prompt, mask) in enumerate(zip(PROMPTS, MASKS)):
        new = out[i * rows : (i + 1) * rows, prompt.shape[1] :].numpy()
        codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
        probs = hf_chain_probs(target, prompt, mask, config, eos=case["eos"])
        p_values.append(assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs))
    return p_values


def main(argv=None) -> int:
    first, last = (int(x) for x in (argv or sys.argv[1:]))
    target, draft = models()
    failures = 0
    for seed in range(first, last):
        case = random_case(seed)
        try:
            verdict = "ok " + " ".join(f"p={p:.2g}" for p in check_case(case, target, draft))
        except AssertionError as error:
            failures += 1
            verdict = "!!! " + str(error).splitlines()[0]
        print(f"{verdict}  {case}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
