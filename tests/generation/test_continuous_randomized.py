"""Continuous batching under random traffic: requests with random prompts (some holding the pad id, some
repetitive so that lookups match), lengths, EOS ids, min_new_tokens, HF logits processors (repetition penalty, n-gram
bans, suppressed tokens, the exponential length penalty) and greedy or seeded sampling settings arrive at random steps,
some are cancelled; on Llama and GPT-2, with a draft model and with prompt lookup, on the dynamic and
the static cache. Every finished request must equal itself decoded alone (greedy: ``model.generate``; sampled:
``speculative_kernels.generate`` with its seed), streamed and final, and a cancelled one a prefix of that.

A wider sweep of the same generator (seeds 0-55 of each of the 8 configurations, with top-k and top-p applied) found
one crash (fixed: a first static batch of one-token requests; the seeds below include it) and one sampled request
that differed from itself alone, for a reason this library does not control: the draft's logits of a row in a batch
and alone differ in the last bits (4e-8 here: the model's matmuls and attention reduce in another order), and two
logits at the top-k boundary were equal to 7 digits, so the row's top-10 set, and its token, differed. A top-k or
top-p cut turns such noise into a different token far more often than the race or the accept test do, so this test
samples without them (kept to fixed cases elsewhere) and stays deterministic on every CPU."""

import random
import warnings

import pytest
import torch

import speculative_kernels as sk
from speculative_kernels import CompileOptions
from helpers.models import gpt2, llama

# CUDA when there is one (gpu.py runs these files there: continuous batching on the GPU), else the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GAMMA = 3
SEEDS = (0, 13, 19)


def _traffic(rng: random.Random) -> list[tuple[int, list[int], dict]]:
    """(arrival step, prompt, settings) in arrival order."""
    traffic = []
    for step in sorted({rng.randrange(0, 12) for _ in range(rng.randint(2, 7))}):
        for _ in range(rng.randint(1, 2)):
            length = rng.randint(1, 20)
            prompt = [rng.randrange(3, 97) for _ in range(length)]
            if rng.random() < 0.3 and length > 2:
                prompt[rng.randrange(0, length - 1)] = 0  # the pad id inside the prompt (masked, as HF does)
            if rng.random() < 0.3:
                prompt = [rng.choice([5, 6])] * length  # repetitive: prompt lookup matches
            settings = dict(max_new_tokens=rng.randint(1, 25))
            if rng.random() < 0.5:
                settings.update(do_sample=True, temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randrange(1000))
                # top-k / top-p are drawn (the seeds stay comparable with the sweep) but not applied: see the
                # module docstring; their per-request handling is tested on fixed cases in the other files
                rng.random() < 0.5 and rng.choice([3, 10])
                rng.random() < 0.3
            else:
                settings["do_sample"] = False
            if rng.random() < 0.3:
                settings["eos_token_id"] = rng.randrange(3, 97)
            if rng.random() < 0.2:
                settings["min_new_tokens"] = rng.randint(0, 5)
            settings.update(_processors(random.Random(rng.random())))  # (its own stream: the draws above stay)
            traffic.append((step, prompt, settings))
    return traffic


def _processors(rng: random.Random) -> dict:
    """A request's HF logits processors, for about a third of the requests (no cutting warper such as min_p: a cut
    turns the models' batched-vs-alone float noise into a different token, see the module docstring)."""
    if rng.random() >= 0.35:
        return {}
    return rng.choice([dict(repetition_penalty=rng.choice([1.3, 0.8])), dict(no_repeat_ngram_size=rng.choice([2, 3])),
                       dict(repetition_penalty=1.2, suppress_tokens=[rng.randrange(3, 97)]),
                       dict(exponential_decay_length_penalty=(rng.randint(1, 4), 1.5), eos_token_id=2)])


def _alone(target, draft, prompt, settings, drafting):
    ids = torch.tensor([prompt], device=DEVICE)
    if not settings.get("do_sample"):
        return target.generate(ids, **settings)[0, len(prompt):].tolist()
    extra = dict(draft_model=draft, num_speculative_tokens=GAMMA) if drafting == "draft_model" else dict(
        prompt_lookup_num_tokens=GAMMA)
    return sk.generate(target, ids, **extra, **settings)[0, len(prompt):].tolist()


# The captured static batch (compile) on the first seed and one pair only: each case compiles its steps (a few graphs
# per step; GPT-2 with a draft model took ~37 s of CPU, Llama with prompt lookup ~15 s). GPT-2 with prompt lookup
# covers both what is compiled only here (learned positions, prompt lookup); test_continuous_compiled.py runs Llama
# with a draft model's captured batch through requests joining and leaving.
CASES = [(seed, family, drafting, cache) for seed in SEEDS for family in ("llama", "gpt2")
         for drafting in ("draft_model", "prompt_lookup") for cache in ("dynamic", "static", "compiled")
         if cache != "compiled" or (seed == SEEDS[0] and (family, drafting) == ("gpt2", "prompt_lookup"))]
COMPILE = CompileOptions() if torch.cuda.is_available() else CompileOptions(backend="aot_eager")


@pytest.mark.parametrize("seed, family, drafting, cache", CASES)
def test_random_traffic_each_request_is_its_own(seed, family, drafting, cache):
    rng = random.Random(seed)
    make = llama if family == "llama" else gpt2
    target, draft = make(seed=seed % 3).to(DEVICE), make(layers=1, seed=seed % 3 + 7).to(DEVICE)
    options = dict(num_speculative_tokens=GAMMA, max_batch_size=rng.choice([2, 3, 8]))
    if cache in ("static", "compiled"):
        options.update(cache_implementation="static", max_context=64)
    if cache == "compiled":
        options["compile"] = COMPILE
    models = (target, draft) if drafting == "draft_model" else (target,)
    if drafting == "prompt_lookup":
        options["prompt_lookup_num_tokens"] = GAMMA
    decoder = sk.SpeculativeDecoder(*models, **options)
    traffic, requests, streamed, cancel_at, cancelled, step = _traffic(rng), {}, {}, {}, set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while traffic or decoder.has_work():
            while traffic and traffic[0][0] <= step:
                _, prompt, settings = traffic.pop(0)
                request_id = decoder.add_request(prompt, **settings)
                requests[request_id] = (prompt, settings)
                if rng.random() < 0.15:
                    cancel_at[request_id] = step + rng.randint(0, 3)
            for request_id in [r for r, at in cancel_at.items() if at == step]:
                decoder.cancel(request_id)
                cancelled.add(request_id)
                del cancel_at[request_id]
            for request_id, tokens in decoder.step().items():
                streamed.setdefault(request_id, []).extend(tokens)
            step += 1
            assert step < 500
        for request_id, (prompt, settings) in requests.items():
            got = decoder.result(request_id).token_ids
            expected = _alone(target, draft, prompt, settings, drafting)
            if request_id in cancelled:
                assert got == expected[: len(got)], (prompt, settings)
            else:
                assert got == expected == streamed.get(request_id, []), (prompt, settings)
