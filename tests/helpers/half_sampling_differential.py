"""Sampling in half and mixed precision: ``speculative_kernels.generate`` against the exact conditionals of HF's chain.

The target is a tiny Llama over VOCAB tokens with eager attention, whose bfloat16 forward is width-invariant on the
CPU (a one-token step, a multi-token verification and a teacher-forced forward give bit-identical logits: 0 of 9472
positions differed, torch 2.13; float16 1 ulp at 3 of them; SDPA differs at 4-16% of positions, which is why this
driver does not use it: a difference would be the model's rounding, not the sampler's). So the distribution of
``model.generate`` in the target's dtype is known exactly from one teacher-forced forward over our own samples: for
each row and position t, p(v | the row's tokens before t) = softmax of HF's processor and warper chain on float32 of
the target's logits (as ``model.generate`` computes it), and the test needs no samples of HF's.

Per prompt (three, left-padded) and position t: the counts of our tokens O[v] against E[v] = sum over rows of
p(v | row's prefix) (Pearson chi-square, cells pooled below 5 expected; conservative under heterogeneous rows), and
for t >= 1 the same per previous token a (O[a, b] against the sum of p(b | prefix) over the rows with token a at
t - 1). A case alarms ("!!!") when its smallest p-value times the number of tests is below 1e-3 (Bonferroni).

Random cases: target/draft dtypes (bfloat16, float16, float32; mixed; float32 models under CPU bfloat16 autocast),
a draft model, a useless draft with ``num_speculative_tokens="auto"`` (drafting pauses: counted in ``paused=``),
prompt lookup, the n-gram drafter or the early-exit draft; temperature, top-k, top-p, min-p, repetition penalty;
``seed=`` or the global generator. ``--mutate NAME`` breaks the sampler on purpose (the power check, ``MUTATIONS``).

    cd tests && python -m helpers.half_sampling_differential 0 20 [--rows 6000] [--new-tokens 12] [--mutate hot]
    cd tests && python -m helpers.half_sampling_differential 40 44 --drafting useless_auto --new-tokens 28  # probes
"""

import argparse
import contextlib
import copy
import inspect
import random
import sys
import textwrap
import time
import warnings

import numpy as np
import torch
from scipy import stats
from transformers import GenerationConfig

import speculative_kernels as sk
from helpers.models import llama, perturbed

VOCAB = 8
ALARM = 1e-3
PROMPTS = [[1, 4, 3, 5, 7], [6, 2, 4], [5]]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# (target, draft) dtypes; "autocast": float32 models under torch.autocast("cpu", dtype=torch.bfloat16)
PAIRS = [("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float32"), ("float32", "bfloat16"),
         ("float16", "bfloat16"), ("bfloat16", "float16"), ("autocast", "autocast")]
SETTINGS = dict(temperature=[1.0, 0.7, 1.4], top_k=[0, 0, 3, 5], top_p=[1.0, 1.0, 0.8, 0.6],
                min_p=[None, None, 0.1, 0.2], repetition_penalty=[1.0, 1.0, 1.5, 0.8])
DRAFTING = ["draft_model", "draft_model", "useless_auto", "prompt_lookup", "ngram", "early_exit"]
# name -> (module, function or Class.method, old source, new source): each a plausible half-precision defect
MUTATIONS = {
    "q-half": ("speculative_kernels.ops.reference", "verify_reference",
               "q, invalid_z = _warped_probs(draft_logits, sampling)",
               "q, invalid_z = _warped_probs(draft_logits, sampling); q = q.to(torch.bfloat16).float()"),
    "ratio-half": ("speculative_kernels.ops.reference", "verify_reference", "(r * q_x < p_x)",
                   "(r < (p_x.to(torch.bfloat16) / q_x.to(torch.bfloat16)).to(torch.bfloat16).float())"),
    "residual-half": ("speculative_kernels.ops.reference", "verify_reference",
                      "residual = torch.clamp(p_n - q_n, min=0.0)",
                      "residual = torch.clamp(p_n.to(torch.bfloat16) - q_n.to(torch.bfloat16), min=0.0).float()"),
    "q-cast": ("speculative_kernels.generation.drafter", "ModelDrafter.propose", "q_logits[:, i] = logits",
               "q_logits[:, i] = logits.to(self.dtype)"),
}


def mutate(name: str) -> None:
    """Replace one line of a library function's source (``MUTATIONS[name]``) and rebind it where it is used."""
    module_name, qualname, old, new = MUTATIONS[name]
    module = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
    owner, _, attr = qualname.rpartition(".")
    holder = getattr(module, owner) if owner else module
    source = textwrap.dedent(inspect.getsource(getattr(holder, attr)))
    assert source.count(old) == 1, f"mutation {name}: {old!r} is not in {qualname} once"
    namespace = dict(module.__dict__)
    exec(compile(source.replace(old, new), module.__file__, "exec"), namespace)
    setattr(holder, attr, namespace[attr])
    if qualname == "verify_reference":  # (the torch backend imported it by name)
        import speculative_kernels.ops.torch_backend as torch_backend
        torch_backend.verify_reference = namespace[attr]


def models(target_dtype: str, draft_dtype: str):
    """(target, draft, useless draft): a 2-layer, hidden-8 Llama over VOCAB tokens with spread-out next-token
    distributions, eager attention and no EOS; a noisy copy of it; a copy whose output layer is negated and sharpened
    (it drafts what the target finds least likely: acceptance near 0, so "auto" pauses drafting)."""
    target = llama(layers=2, hidden=8, vocab=VOCAB, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.generation_config.eos_token_id = None
    target.config._attn_implementation = "eager"
    draft, useless = perturbed(target, 0.3), copy.deepcopy(target)
    with torch.no_grad():
        useless.lm_head.weight.mul_(-30.0)
    as_float = {"autocast": torch.float32}
    return (target.to(as_float.get(target_dtype) or DTYPES[target_dtype]),
            draft.to(as_float.get(draft_dtype) or DTYPES[draft_dtype]),
            useless.to(as_float.get(draft_dtype) or DTYPES[draft_dtype]))


def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    drafting = rng.choice(DRAFTING)
    gamma = {"draft_model": rng.choice([1, 2, 4, "auto"]), "early_exit": rng.choice([1, 3, "auto"]),
             "useless_auto": "auto"}.get(drafting, rng.choice([2, 3]))
    settings = {k: rng.choice(v) for k, v in SETTINGS.items()}
    return dict(seed=seed, dtypes=rng.choice(PAIRS), drafting=drafting, gamma=gamma, seeded=rng.random() < 0.5,
                settings={k: v for k, v in settings.items() if v is not None})


def prompts(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPTS left-padded, each repeated ``rows`` times: (ids [3 rows, W], mask [3 rows, W])."""
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids.repeat_interleave(rows, 0), mask.repeat_interleave(rows, 0)


class PauseCounter:
    """Counts the iterations run with "auto" drafting paused (gamma 0 after the calibrator chose to pause), and the
    probes among them (an iteration that drafts while paused, after ``gamma.PROBE_EVERY`` plain ones)."""

    def __init__(self):
        from speculative_kernels.generation.loop import SpeculativeLoop
        self.paused, self.probes, self._loop_class, self._verify = 0, 0, SpeculativeLoop, SpeculativeLoop._verify
        counter = self

        def verify(loop, *args, **kwargs):
            if loop.calibrator is not None and loop.calibrator.paused:
                counter.paused += loop.gamma == 0
                counter.probes += loop.gamma > 0
            return counter._verify(loop, *args, **kwargs)

        SpeculativeLoop._verify = verify

    def close(self):
        self._loop_class._verify = self._verify


def our_samples(case: dict, target, draft, useless, ids, mask, new: int, hotter: float, chunk: int) -> torch.Tensor:
    """Our continuations [rows, new] of ids/mask, generated ``chunk`` rows per call."""
    settings = {"top_k": 0, **case["settings"]}  # (HF's default top_k=50 is past VOCAB: no cut either way)
    if hotter != 1.0:
        settings["temperature"] = settings.get("temperature", 1.0) * hotter
    drafting = {"draft_model": dict(draft_model=draft, num_speculative_tokens=case["gamma"]),
                "useless_auto": dict(draft_model=useless, num_speculative_tokens="auto"),
                "early_exit": dict(assistant_early_exit=1, num_speculative_tokens=case["gamma"]),
                "prompt_lookup": dict(prompt_lookup_num_tokens=case["gamma"]),
                "ngram": dict(drafter=sk.NGramDrafter(VOCAB))}[case["drafting"]]
    if case["drafting"] == "useless_auto":  # (small calls: the draft's cost relative to a verification, c, is then
        chunk = min(chunk, 600)  # large enough that "auto" pauses; a batch of 30000 rows measured c = 0.22, no pause)
    outs = []
    for start in range(0, ids.shape[0], chunk):
        seed = case["seed"] * 1000 + start // chunk
        torch.manual_seed(seed)
        out = sk.generate(target, ids[start:start + chunk], attention_mask=mask[start:start + chunk],
                          do_sample=True, max_new_tokens=new, pad_token_id=0,
                          seed=seed if case["seeded"] else None, **settings, **drafting)
        outs.append(out[:, ids.shape[1]:])
    return torch.cat(outs)


@torch.no_grad()
def hf_conditionals(target, settings: dict, ids, mask, tokens, chunk: int) -> np.ndarray:
    """[rows, new, V] float64: p(v | prompt, the row's tokens before t) under ``model.generate``'s sampling in the
    target's dtype: HF's own processor and warper chain on float32 of one teacher-forced forward's logits."""
    config = GenerationConfig(do_sample=True, max_new_tokens=tokens.shape[1], pad_token_id=0, eos_token_id=None,
                              **{"top_k": 0, **settings})
    config, _ = target._prepare_generation_config(config)
    target._prepare_special_tokens(config, True, device="cpu")
    width = ids.shape[1]
    config.max_length = width + tokens.shape[1]
    result = []
    for start in range(0, ids.shape[0], chunk):
        rows = slice(start, start + chunk)
        seq = torch.cat([ids[rows], tokens[rows]], dim=1)
        full_mask = torch.cat([mask[rows], torch.ones_like(tokens[rows])], dim=1)
        logits = target(seq, attention_mask=full_mask, position_ids=(full_mask.cumsum(1) - 1).clamp(min=0)).logits
        chain = target._get_logits_processor(generation_config=config, input_ids_seq_length=width, device="cpu",
                                             encoder_input_ids=ids[rows], model_kwargs={"attention_mask": mask[rows]})
        probs = [torch.softmax(chain(seq[:, :width + t], logits[:, width + t - 1].float().clone()).double(), dim=-1)
                 for t in range(tokens.shape[1])]
        result.append(torch.stack(probs, dim=1).numpy())
    return np.concatenate(result)


def pearson(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """(chi-square, degrees of freedom) of counts against expectations with the same total; cells expected below
    5 pooled into one."""
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(observed[~big].sum())
        exp.append(expected[~big].sum())
    if any(o > 0 for o, e in zip(obs, exp) if e == 0):
        return float("inf"), 1  # a token of probability 0 was drawn
    obs, exp = np.array(obs), np.array(exp)
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def case_p_values(tokens: np.ndarray, probs: np.ndarray) -> list[float]:
    """One prompt's rows: tokens [R, new], probs [R, new, V] -> p-values: per position, and per position t >= 1
    grouped by the token at t - 1."""
    p_values = []
    for t in range(tokens.shape[1]):
        chi2, dof = pearson(np.bincount(tokens[:, t], minlength=VOCAB), probs[:, t].sum(axis=0))
        p_values.append(stats.chi2.sf(chi2, dof) if dof > 0 else 1.0)
        if t == 0:
            continue
        total, total_dof = 0.0, 0
        for a in range(VOCAB):
            rows = tokens[:, t - 1] == a
            if rows.sum() == 0:
                continue
            chi2, dof = pearson(np.bincount(tokens[rows, t], minlength=VOCAB), probs[rows, t].sum(axis=0))
            total, total_dof = total + chi2, total_dof + dof
        p_values.append(stats.chi2.sf(total, total_dof) if total_dof > 0 else 1.0)
    return p_values


def check_case(case: dict, rows: int, new: int, hotter: float = 1.0, chunk: int = 30000) -> tuple[float, int, str]:
    """(the smallest p-value, the number of tests, iterations run paused and probes among them) of one case."""
    target_dtype, draft_dtype = case["dtypes"]
    target, draft, useless = models(target_dtype, draft_dtype)
    ids, mask = prompts(rows)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if target_dtype == "autocast"
                else contextlib.nullcontext())
    counter = PauseCounter()
    try:
        with warnings.catch_warnings(), autocast:
            warnings.simplefilter("ignore")
            tokens = our_samples(case, target, draft, useless, ids, mask, new, hotter, chunk)
            probs = hf_conditionals(target, case["settings"], ids, mask, tokens, chunk)
    finally:
        counter.close()
    tokens = tokens.numpy()
    p_values = []
    for g in range(len(PROMPTS)):
        part = slice(g * rows, (g + 1) * rows)
        p_values += case_p_values(tokens[part], probs[part])
    return min(p_values), len(p_values), f"{counter.paused} (probes {counter.probes})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=int, help="first seed (inclusive)")
    parser.add_argument("last", type=int, help="last seed (exclusive)")
    parser.add_argument("--rows", type=int, default=20000, help="rows per prompt")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--mutate", choices=["hot", *MUTATIONS], help="break the sampler on purpose (power check)")
    parser.add_argument("--dtypes", help="run every case with these target,draft dtypes (e.g. bfloat16,float32)")
    parser.add_argument("--drafting", choices=sorted(set(DRAFTING)), help="run every case with this drafting")
    args = parser.parse_args(argv)
    if args.mutate in MUTATIONS:
        mutate(args.mutate)
    alarms = 0
    for seed in range(args.first, args.last):
        case = random_case(seed)
        if args.dtypes:
            case["dtypes"] = tuple(args.dtypes.split(","))
        if args.drafting:
            case["drafting"] = args.drafting
            case["gamma"] = "auto" if args.drafting == "useless_auto" else (
                case["gamma"] if isinstance(case["gamma"], int) or args.drafting in ("draft_model", "early_exit")
                else 3)
        start = time.time()
        try:
            p_min, tests, paused = check_case(case, args.rows, args.new_tokens, 1.1 if args.mutate == "hot" else 1.0)
            alarm = p_min * tests < ALARM
            alarms += alarm
            verdict = f"{'!!!' if alarm else 'ok '} min p={p_min:.2g} x {tests} tests, paused={paused}"
        except ValueError as error:  # a refusal by name
            verdict = "refused: " + str(error)[:200].replace("\n", " ")
        print(f"{verdict} ({time.time() - start:.0f} s)  {case}", flush=True)
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
