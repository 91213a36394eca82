"""A randomized sampling differential check: random processor, warper and EOS settings, drafted by a draft model,
prompt lookup or the n-gram drafter, on two prompts (one padded) of a tiny model over VOCAB tokens (a Llama, or a
T5/BART encoder-decoder pair); each prompt's whole continuations against the exact distribution of HF's own chain for
that row (chi-square).

    cd tests && python -m helpers.sampling_differential 0 80 [llama|t5|bart|marian|...]   # "!!!" on a mismatch
"""

import argparse
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
from helpers.seq2seq_models import ALL_SEQ2SEQ_FAMILIES
from helpers.stats import assert_matches

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
SEQ2SEQ_SETTINGS = dict(encoder_no_repeat_ngram_size=[0, 0, 2], forced_bos_token_id=[None, None, 4])
EOS_SETTINGS = dict(min_new_tokens=[None, 1, 2], exponential_decay_length_penalty=[None, (1, 1.5)],
                    forced_eos_token_id=[None, "eos"], min_length=[None, "+2"])
# Output scales giving spread-out continuation distributions (no single continuation dominates); 1.0 where unnamed.
LOGIT_SCALE = {"llama": 8.0, "t5": 0.3, "bart": 2.0, "longt5": 0.3, "switch_transformers": 0.6, "t5gemma": 6.0,
               "t5gemma2": 6.0, "pegasus_x": 2.0}


def models(family: str = "llama"):
    """(target, draft): a model over VOCAB tokens whose output layer is scaled for a spread-out distribution, EOS
    and forced tokens off by default, and a noisy copy of it as the draft."""
    make = llama if family == "llama" else ALL_SEQ2SEQ_FAMILIES[family]
    target = make(layers=2, vocab=VOCAB, seed=0)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(LOGIT_SCALE.get(family, 1.0))
    target.generation_config.eos_token_id = None
    target.generation_config.forced_bos_token_id = None
    target.generation_config.forced_eos_token_id = None
    return target, perturbed(target, 0.3)


def prompts(target) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two prompts and their masks: a decoder-only model's second one left-padded, an encoder-decoder model's
    second source right-padded (as each is padded for generate)."""
    pad = target.config.pad_token_id
    if target.config.is_encoder_decoder:
        return ([torch.tensor([[3, 4, 5, 3, 4]]), torch.tensor([[4, 4, 5, pad, pad]])],
                [torch.ones(1, 5, dtype=torch.long), torch.tensor([[1, 1, 1, 0, 0]])])
    return ([torch.tensor([[1, 4, 3, 5]]), torch.tensor([[pad, 4, 4, 2]])],
            [torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 1]])])


def random_case(seed: int, family: str = "llama") -> dict:
    rng = random.Random(seed)
    settings = {k: rng.choice(v) for k, v in SETTINGS.items()}
    if family != "llama":
        settings.update({k: rng.choice(v) for k, v in SEQ2SEQ_SETTINGS.items()})
    eos = "eos" if rng.random() < 0.5 else None  # (the model's own EOS id, set by check_case)
    if eos is not None:
        settings.update({k: rng.choice(v) for k, v in EOS_SETTINGS.items()})
    drafting = rng.choice(["draft_model", "prompt_lookup", "ngram"])
    gamma = rng.choice([1, 2, 3]) if drafting == "draft_model" else rng.choice([2, 3])
    return dict(seed=seed, family=family, eos=eos, drafting=drafting, gamma=gamma,
                settings={k: v for k, v in settings.items() if v is not None})


def check_case(case: dict, target, draft, rows: int = 1500, reference=None) -> list[float]:
    """The chi-square p-value of each prompt's continuations (rows of each); AssertionError on a mismatch.
    target and draft may be on a GPU (the kernels' end-to-end check); reference: the target on the CPU, where HF's
    chain is enumerated (None: the target itself)."""
    reference = target if reference is None else reference
    device = next(target.parameters()).device
    eos = target.config.eos_token_id if case["eos"] else None
    ids, masks = prompts(target)
    resolved = {"eos": eos, "+2": ids[0].shape[1] + 2 if not target.config.is_encoder_decoder else 3}
    settings = {k: resolved.get(v, v) if isinstance(v, str) else v for k, v in case["settings"].items()}
    config = GenerationConfig(do_sample=True, max_new_tokens=NEW, pad_token_id=target.config.pad_token_id,
                              eos_token_id=eos, **settings)
    extra = {"draft_model": dict(draft_model=draft, num_speculative_tokens=case["gamma"]),
             "prompt_lookup": dict(prompt_lookup_num_tokens=case["gamma"]),
             "ngram": dict(drafter=sk.NGramDrafter(VOCAB))}[case["drafting"]]
    torch.manual_seed(case["seed"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = sk.generate(target, torch.cat([p.expand(rows, -1) for p in ids]).to(device),
                          attention_mask=torch.cat([m.expand(rows, -1) for m in masks]).to(device),
                          generation_config=copy.deepcopy(config), **extra).cpu()
    p_values = []
    width = 1 if target.config.is_encoder_decoder else ids[0].shape[1]  # (the decoder's start token / the prompt)
    if out.shape[1] < width + NEW:  # every row ended early: padded as HF pads
        out = torch.nn.functional.pad(out, (0, width + NEW - out.shape[1]), value=config.pad_token_id)
    for i, (prompt, mask) in enumerate(zip(ids, masks)):
        new = out[i * rows : (i + 1) * rows, width:].numpy()
        codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
        probs = hf_chain_probs(reference, prompt, mask, config, eos=eos)
        p_values.append(assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs))
    return p_values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=int, help="first seed (inclusive)")
    parser.add_argument("last", type=int, help="last seed (exclusive)")
    parser.add_argument("family", nargs="?", default="llama", choices=["llama", *ALL_SEQ2SEQ_FAMILIES])
    args = parser.parse_args(argv)
    first, last, family = args.first, args.last, args.family
    target, draft = models(family)
    failures = 0
    for seed in range(first, last):
        case = random_case(seed, family)
        try:
            verdict = "ok " + " ".join(f"p={p:.2g}" for p in check_case(case, target, draft))
        except AssertionError as error:
            failures += 1
            verdict = "!!! " + str(error).splitlines()[0]
        except ValueError as error:  # a refusal by name
            verdict = "refused: " + str(error)[:200]
        print(f"{verdict}  {case}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
