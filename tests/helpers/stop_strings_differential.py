"""Stop-strings differential on the demo pair (the one model here with a real tokenizer): random stop strings cut
from ``model.generate``'s own greedy continuation (at any character: inside tokens, across token boundaries, several
at once, and one that never matches), batch 1 to 3 left-padded, greedy; ``speculative_kernels.generate`` with the
draft model and with prompt lookup must equal ``model.generate(stop_strings=..., tokenizer=...)`` token for token.

    cd tests && python -m helpers.stop_strings_differential 0 100      # seeds 0..99 (about 2 s a case)
"""

import logging
import random
import sys
import warnings

import torch

import speculative_kernels as sk
from speculative_kernels.demo import BUILTIN_PROMPTS


def random_case(seed: int, tokenizer, target) -> dict:
    """A seeded case: the batch (tokenized), max_new_tokens, gamma, the stop strings, and whether they cut a row
    (model.generate's output differs from its output without them)."""
    rng = random.Random(seed)
    prompts = rng.sample(BUILTIN_PROMPTS, rng.choice([1, 1, 2, 3]))
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    new = rng.choice([8, 16, 30])
    plain = target.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    texts = [tokenizer.decode(row[batch["input_ids"].shape[1]:]) for row in plain]
    stops = []
    for _ in range(rng.randint(1, 3)):
        text = rng.choice(texts)
        if len(text) >= 3:
            first = rng.randrange(len(text) - 2)
            stops.append(text[first:first + rng.randint(1, 6)])
    if rng.random() < 0.3 or not stops:
        stops.append("zzzq")  # never generated
    return {"seed": seed, "batch": batch, "max_new_tokens": new, "gamma": rng.choice([1, 3, 5]), "plain": plain,
            "stop_strings": list(dict.fromkeys(stops))}


def check_case(case: dict, target, draft, tokenizer) -> bool:
    """Raises AssertionError naming the case where ours differs; returns whether the stop strings cut a row."""
    kwargs = dict(max_new_tokens=case["max_new_tokens"], do_sample=False, stop_strings=case["stop_strings"],
                  tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
    expected = target.generate(**case["batch"], **kwargs)
    for drafting in (dict(draft_model=draft, num_speculative_tokens=case["gamma"]),
                     dict(prompt_lookup_num_tokens=case["gamma"])):
        got = sk.generate(target, **case["batch"], **drafting, **kwargs)
        assert got.shape == expected.shape and torch.equal(got, expected), (
            f"seed {case['seed']} {drafting.keys()} gamma {case['gamma']} stop_strings {case['stop_strings']!r}:\n"
            f"  model.generate {expected.tolist()}\n  ours {got.tolist()}")
    plain = case["plain"][:, : expected.shape[1]]
    return expected.shape != case["plain"].shape or not torch.equal(expected, plain)


def main(argv=None) -> int:
    from speculative_kernels.demo_pair import load_demo_pair

    args = sys.argv[1:] if argv is None else argv
    start, count = (int(args[0]), int(args[1])) if len(args) == 2 else (0, 50)
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    target, draft, tokenizer = load_demo_pair()
    tokenizer.padding_side = "left"
    defects, cut = [], 0
    for seed in range(start, start + count):
        try:
            cut += check_case(random_case(seed, tokenizer, target), target, draft, tokenizer)
        except AssertionError as error:
            defects.append(seed)
            print("DEFECT", error, flush=True)
    print(f"{count} cases, {cut} cut by their stop strings; defects: {defects}")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
