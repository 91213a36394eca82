"""Greedy differential draws of what ``differential.py`` and ``test_differential_broad.py`` never vary, against
plain ``model.generate`` (the reference the project promises): sequences exactly, output class and fields, the count
and shapes of scores/logits, their values to HF's own float error (``float_error``), finished rows' zeros.

Drawn here and nowhere else: ``prefill_chunk_size`` (1-8); ``batching=BatchingOptions(...)`` (compaction threshold,
dropping of finished rows, static slack); batches of up to 8 and prompts of up to 40 tokens, and prompts near a
512-position table (HF caps its default ``max_length`` there); ``max_new_tokens`` up to 64; gamma 9-64 and
``"auto"`` with every drafter, given as ``num_speculative_tokens``, ``num_assistant_tokens`` or the draft's
``generation_config.num_assistant_tokens``; ``assistant_early_exit``; prompt lookup with k up to 20; masks as bool
or float, and with a masked slot inside a prompt; a prompt cache (``past_key_values``, HF's recipe);
``prefix_allowed_tokens_fn``; settings layered as a checkpoint sets them (the model's ``generation_config`` holding
defaults and decoys under the call's keywords or ``generation_config``); encoder-decoder decoder prompts of other
lengths per row (left-padded, ``decoder_attention_mask``). ``--compile BACKEND`` adds ``compile=CompileOptions(
backend=BACKEND)`` ("aot_eager" on the CPU: about 7 s a draw).

Verdicts: "same"; "refused: ..." (ours raised ValueError/TypeError: printed for review, each one a documented
refusal in the runs so far); "both-raise"; "hf-only-error" (HF raised, ours ran: printed for review). A difference
or our own other exception prints DEFECT.

    cd tests && python -m helpers.wide_differential --cases 300 --start 0     # about 0.5-1 s a draw on one core

Where HF is not the reference: an encoder-decoder's chunked prefill (HF slices the encoder's mask to the decoder
chunk: other tokens or a size error, ``test_prefill_chunks.py``) is compared with HF's unchunked run; a checkpoint's
``prompt_lookup_num_tokens`` (HF's lookup refuses batches) with HF's run without it (greedy: the same tokens); a
prompt cache with ``prefill_chunk_size`` with HF's unchunked run (transformers 5.17's chunked prefill over a prompt
cache gives other tokens, or fails on BLOOM: README). Logit values are compared with a prompt cache only for unpadded
prompts (HF's recipe fills the cache without the mask's positions, which a teacher-forced reference does not share).
First runs (2026-11-28, 2 shared CPU cores): transformers 5.24, draws 0-1999 (an earlier form; its three harness
bugs fixed) and 0-399 again: no defect; 5.17, draws 5000-5199: no defect; --compile aot_eager, draws 40000-40041:
no defect (26 compared, 15 documented refusals of compile's limits).
"""

import argparse
import collections
import copy
import functools
import random
import sys
import time
import traceback
import types

import torch
from transformers import DynamicCache, GenerationConfig

import speculative_kernels as sk
from helpers.differential import assert_same_output_form, quiet
from helpers.float_error import NoFloat64Reference, assert_logits_as_accurate_as_hf, processor_gain
from helpers.models import VOCAB, decoder_only_families, perturbed
from helpers.seq2seq_models import family_model

DECODER_ONLY = sorted(decoder_only_families())
SEQ2SEQ = ["t5", "bart", "mbart"]
COMPILE_BACKEND = [None]  # --compile
EARLY_EXIT_OK = {"llama", "qwen2", "mistral", "phi3", "qwen3", "gemma2"}  # slice layers by num_hidden_layers


@functools.lru_cache(maxsize=None)
def target_of(family: str):
    """The target of ``family``, built once per process."""
    return family_model(family)


@functools.lru_cache(maxsize=None)
def draft_of(family: str, kind: str, arg=None):
    """A draft for ``family``'s target: itself ("self"), a noisy copy ("perturbed", noise ``arg``), or a 1-layer
    model of the family ("unrelated")."""
    t = target_of(family)
    if kind == "self":
        return t
    if kind == "perturbed":
        return perturbed(t, scale=arg).eval()
    if kind == "unrelated":
        return family_model(family, layers=1, hidden=16, seed=123)
    raise KeyError(kind)


def draw(seed: int) -> dict:
    """The seeded draw ``seed``: plain values (``build`` turns them into the call)."""
    rng = random.Random(seed)
    c = {"seed": seed}
    family = c["family"] = rng.choice(DECODER_ONLY * 2 + SEQ2SEQ)
    seq2seq = family in SEQ2SEQ
    batch = c["batch"] = rng.choice([1, 1, 2, 3, 4, 5, 6, 8])
    c["lengths"] = [rng.choice([1, 2, 3, 5, 8, 13, 20, 31, 40]) for _ in range(batch)]
    c["tokens"] = [[rng.randrange(5, VOCAB) for _ in range(n)] for n in c["lengths"]]
    c["mask_dtype"] = rng.choice(["long", "long", "bool", "float", "none"])
    c["hole"] = (not seq2seq) and rng.random() < 0.12
    c["eos"] = rng.choice(["config", "frequent", "frequent", "frequent_list", "list", "none"])
    c["frequent_step"] = rng.randint(0, 10)
    c["pad"] = rng.choice(["config", "eos", "eos", "none", "other"])
    c["length"] = rng.choice(["new", "new", "new", "max_length", "both", "default"])
    c["max_new_tokens"] = rng.choice([1, 2, 3, 7, 16, 17, 31, 48, 64])
    c["max_length_extra"] = rng.randint(1, 50)
    c["min_new_tokens"] = rng.choice([None, None, None, 0, 3, 10])
    drafters = ["self", "perturbed", "perturbed", "unrelated", "prompt_lookup", "ngram"]
    if family in EARLY_EXIT_OK:
        drafters.append("early_exit")
    c["drafter"] = rng.choice(drafters)
    c["perturb"] = rng.choice([0.02, 0.1])
    c["gamma"] = rng.choice([None, 1, 2, 5, 8, 9, 12, 15, 16, 17, 20, 32, 64, "auto"])
    c["lookup_k"] = rng.choice([1, 3, 8, 12, 16, 20])
    c["ngram_order"] = rng.choice([1, 2, 3])
    c["gamma_via"] = rng.choice(["kwarg", "kwarg", "num_assistant_tokens", "draft_config"])
    c["prefill_chunk"] = rng.choice([None, None, 1, 2, 3, 5, 8])
    c["batching"] = rng.choice([None, None, (0.01, 0.01, None), (1.0, None, None), (0.25, 1.0, 0.0),
                                (0.01, None, 4.0), (0.5, 0.5, 0.5)])
    c["cache"] = rng.choice([None, None, "dynamic", "static"])
    c["output"] = rng.choice(["tensor", "tensor", "dict", "scores", "logits", "both"])
    c["how"] = rng.choice(["kwargs", "kwargs", "config", "model_config"])
    c["processor"] = rng.choice([None, None, None, "prefix_fn", "repetition_penalty", "no_repeat_ngram_size",
                                 "suppress_tokens", "sequence_bias"])
    c["prompt_cache"] = (not seq2seq) and rng.random() < 0.15
    c["cached_cols"] = rng.random()
    c["decoder_prompt"] = seq2seq and rng.random() < 0.3
    c["decoder_tokens"] = [rng.randrange(5, VOCAB) for _ in range(rng.randint(1, 4))]
    c["decoder_ragged"] = [rng.randint(0, 4) for _ in range(batch)] if rng.random() < 0.5 else None
    # prompts near a 512-position table (HF caps its default max_length there)
    c["long"] = (not seq2seq) and family != "bloom" and rng.random() < 0.08
    if c["long"]:
        c["lengths"][0] = rng.randint(488, 511)
        c["tokens"][0] = [rng.randrange(5, VOCAB) for _ in range(c["lengths"][0])]
        c["length"] = rng.choice(["default", "default", "new", "max_length"])
        c["max_length_extra"] = rng.randint(1, 30)
    c["how"] = rng.choice([c["how"], "layered", "layered"])
    c["layer_seed"] = rng.randrange(10**6)
    c["checkpoint"] = rng.choice([{}, {}, {"max_length": 30}, {"eos_token_id": "two"}, {"num_assistant_tokens": 3},
                                  {"repetition_penalty": 1.1}, {"no_repeat_ngram_size": 3}, {"min_length": 5},
                                  {"prompt_lookup_num_tokens": 4}, {"max_new_tokens": 12}, {"pad_token_id": "eos"},
                                  {"min_new_tokens": 2}, {"cache_implementation": "static"},
                                  {"max_length": 30, "max_new_tokens": 6}, {"do_sample": False, "top_k": 5}])
    return c


def _prefix_fn(batch_id, ids):
    """A deterministic constraint of the context: bans a third of the vocabulary, which third by the context sum."""
    k = int(ids.sum()) % 3
    return [t for t in range(VOCAB) if t % 3 != k]


def build(c: dict):
    """(target, draft or None, ids [B, L], mask [B, L], settings (as model.generate takes them), our extra keywords
    (drafting, batching, compile), the prompt cache or None, the draft's generation_config.num_assistant_tokens or
    None) of draw ``c``."""
    target = target_of(c["family"])
    seq2seq = target.config.is_encoder_decoder
    pad_model = target.config.pad_token_id
    width = max(c["lengths"])
    ids = torch.full((c["batch"], width), pad_model, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(c["tokens"]):
        span = slice(0, len(row)) if seq2seq else slice(width - len(row), width)
        ids[b, span], mask[b, span] = torch.tensor(row), 1
    if c["hole"]:  # a masked slot inside the longest row, after its first real token, before its last
        b = max(range(c["batch"]), key=lambda r: c["lengths"][r])
        if c["lengths"][b] >= 3:
            mask[b, width - c["lengths"][b] + 1] = 0
    s = {"do_sample": False}
    padded = bool((mask == 0).any())
    if c["mask_dtype"] != "none" or padded:
        s["attention_mask"] = {"long": mask, "none": mask, "bool": mask.bool(), "float": mask.float()}[c["mask_dtype"]]
    config = target.generation_config
    eos_model = config.eos_token_id
    if c["eos"].startswith("frequent"):
        try:
            with quiet():
                plain = target.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=c["frequent_step"] + 1,
                                        do_sample=False, eos_token_id=None, pad_token_id=pad_model)
            new = plain[0, 1 if seq2seq else width:].tolist()
            frequent = new[min(c["frequent_step"], len(new) - 1)]
        except IndexError:  # (a prompt near a learned position table: the probe runs past it)
            frequent = eos_model
        s["eos_token_id"] = frequent if c["eos"] == "frequent" else [frequent, eos_model]
    elif c["eos"] == "list":
        s["eos_token_id"] = [eos_model, 50]
    elif c["eos"] == "none":
        s["eos_token_id"] = None
    eos_now = s.get("eos_token_id", eos_model)
    first_eos = None if eos_now is None else int(torch.as_tensor(eos_now).flatten()[0])
    if c["pad"] == "eos" and first_eos is not None:
        s["pad_token_id"] = first_eos
    elif c["pad"] == "none":
        s["pad_token_id"] = None
    elif c["pad"] == "other":
        s["pad_token_id"] = 4
    start = 1 if seq2seq else width
    if c["decoder_prompt"]:
        dec = [target.generation_config.decoder_start_token_id, *c["decoder_tokens"]]
        if c.get("decoder_ragged"):  # rows of other lengths, left-padded, with a decoder_attention_mask
            rows = [dec[:1 + n] for n in c["decoder_ragged"]]
            w = max(map(len, rows))
            s["decoder_input_ids"] = torch.tensor([[pad_model] * (w - len(r)) + r for r in rows])
            s["decoder_attention_mask"] = torch.tensor([[0] * (w - len(r)) + [1] * len(r) for r in rows])
            start = w
        else:
            s["decoder_input_ids"] = torch.tensor([dec] * c["batch"])
            start = len(dec)
    if c["length"] in ("new", "both"):
        s["max_new_tokens"] = c["max_new_tokens"]
    if c["length"] in ("max_length", "both"):
        s["max_length"] = start + c["max_length_extra"]
    if c["min_new_tokens"] is not None:
        s["min_new_tokens"] = c["min_new_tokens"]
    p = c["processor"]
    if p == "prefix_fn":
        s["prefix_allowed_tokens_fn"] = _prefix_fn
    elif p == "repetition_penalty":
        s[p] = 1.4
    elif p == "no_repeat_ngram_size":
        s[p] = 2
    elif p == "suppress_tokens":
        s[p] = [7, 8, 9, 10]
    elif p == "sequence_bias":
        s[p] = {(11,): 5.0, (12, 13): -4.0}
    if c["cache"]:
        s["cache_implementation"] = c["cache"]
    if c["prefill_chunk"]:
        s["prefill_chunk_size"] = c["prefill_chunk"]
    if c["output"] != "tensor":
        s["return_dict_in_generate"] = True
        s["output_scores"] = c["output"] in ("scores", "both")
        s["output_logits"] = c["output"] in ("logits", "both")
    cache = None
    if c["prompt_cache"] and width >= 2 and not c["cache"]:
        cached = 1 + int(c["cached_cols"] * (width - 1))  # 1 .. width-1
        cached = min(cached, width - 1)
        cache = DynamicCache()
        with torch.no_grad():
            target(ids[:, :cached], attention_mask=mask[:, :cached], past_key_values=cache)
    ours = {}
    d = c["drafter"]
    draft = None
    if d in ("self", "perturbed", "unrelated"):
        draft = draft_of(c["family"], d, c["perturb"] if d == "perturbed" else None)
        ours["draft_model"] = draft
    elif d == "prompt_lookup":
        ours["prompt_lookup_num_tokens"] = c["lookup_k"]
    elif d == "ngram":
        ours["drafter"] = sk.NGramDrafter.for_model(target, order=c["ngram_order"])
    elif d == "early_exit":
        ours["assistant_early_exit"] = 1
    gamma = c["gamma"]
    draft_config = None
    if gamma is not None and d != "prompt_lookup":
        via = c["gamma_via"]
        if gamma == "auto" or via == "kwarg" or d not in ("self", "perturbed", "unrelated"):
            ours["num_speculative_tokens"] = gamma
        elif via == "num_assistant_tokens":
            ours["num_assistant_tokens"] = gamma
        else:
            draft_config = gamma
    if COMPILE_BACKEND[0]:  # compile=: captured draft and verification steps
        ours["compile"] = sk.CompileOptions(backend=COMPILE_BACKEND[0])
    if c["batching"]:
        t, f, sl = c["batching"]
        ours["batching"] = sk.BatchingOptions(compaction_threshold=t, drop_finished_fraction=f, static_slack=sl)
    return target, draft, ids, mask, s, ours, cache, draft_config


CALL_ONLY = ("attention_mask", "decoder_input_ids", "decoder_attention_mask", "prefix_allowed_tokens_fn",
             "past_key_values")  # generate's arguments that are no GenerationConfig fields


DECOYS = {"max_new_tokens": 3, "max_length": 9, "eos_token_id": [5, 6], "pad_token_id": 3, "min_new_tokens": 1,
          "repetition_penalty": 2.0, "no_repeat_ngram_size": 1, "suppress_tokens": [20, 21], "do_sample": False,
          "output_scores": True, "return_dict_in_generate": True, "cache_implementation": "static",
          "prefill_chunk_size": 2}


def _checkpoint(target, c):
    """c["checkpoint"]: fields a checkpoint's generation_config.json sets, resolved for ``target``."""
    out = {}
    eos = target.generation_config.eos_token_id
    for k, v in c.get("checkpoint", {}).items():
        if v == "two":
            v = [eos, 60]
        elif v == "eos":
            v = eos
        out[k] = v
    return out


def call(fn, target, ids, s: dict, how: str, extra: dict, c: dict):
    """``fn(ids, ...)`` with settings ``s`` passed as ``how`` says: keywords, a copy of the model's generation_config,
    set on the model's generation_config (restored after), or "layered" (the draw's checkpoint fields and decoys on
    the model's generation_config, each setting there or in the call); ``extra``: keywords that win over ``s``."""
    kwargs = {k: v for k, v in s.items() if k in CALL_ONLY}
    every = {k: v for k, v in s.items() if k not in CALL_ONLY}
    fields = {k: v for k, v in every.items() if k not in extra}  # (extra: keywords, which win)
    if how == "layered":  # checkpoint defaults on the model's generation_config; each field from the model, the
        # call, or the call over a decoy on the model's
        rng = random.Random(c["layer_seed"])
        model_fields = dict(_checkpoint(target, c))
        call_fields = {}
        for k in sorted(every):  # (every field: HF's run and ours, whose extras differ, are layered alike)
            where = rng.choice(["model", "call", "call", "decoy"])
            if where == "model":
                model_fields[k] = every[k]
            else:
                call_fields[k] = every[k]
                if where == "decoy" and k in DECOYS:
                    model_fields[k] = DECOYS[k]
        call_fields = {k: v for k, v in call_fields.items() if k not in extra}
        as_config = rng.random() < 0.3
        saved = copy.deepcopy(target.generation_config)
        try:
            for k, v in model_fields.items():
                setattr(target.generation_config, k, v)
            if as_config:
                return fn(ids, generation_config=GenerationConfig(**call_fields), **kwargs, **extra)
            return fn(ids, **kwargs, **call_fields, **extra)
        finally:
            target.generation_config = saved
    if how == "kwargs":
        return fn(ids, **kwargs, **fields, **extra)
    if how == "config":
        config = copy.deepcopy(target.generation_config)
        for k, v in fields.items():
            setattr(config, k, v)
        return fn(ids, generation_config=config, **kwargs, **extra)
    saved = copy.deepcopy(target.generation_config)
    try:
        for k, v in fields.items():
            setattr(target.generation_config, k, v)
        return fn(ids, **kwargs, **extra)
    finally:
        target.generation_config = saved


def _ids(v) -> list[int]:
    return [] if v is None else torch.as_tensor(v).flatten().tolist()


def live_mask(seqs, width: int, steps: int, eos: set, pads: set) -> torch.Tensor:
    """[B, steps] bool: the steps before which row b had not finished (an EOS id followed by padding only)."""
    live = torch.ones(len(seqs), steps, dtype=torch.bool)
    for b in range(len(seqs)):
        for t in range(steps):
            tok = int(seqs[b, width + t])
            if tok in eos and all(int(x) in pads for x in seqs[b, width + t + 1:]):
                live[b, t + 1:] = False
                break
    return live


def compare(target, got, expected, reference, ids, s: dict, resolved) -> None:
    """AssertionError where ``got`` (ours) differs from ``expected`` (HF's); ``reference``: HF's run with scores and
    logits both (their float error's reference); ``resolved``: the GenerationConfig HF's generate merged."""
    if assert_same_output_form(got, expected):
        return
    steps = len(reference.logits)
    width = expected.sequences.shape[1] - steps
    eos = set(_ids(resolved.eos_token_id))
    pads = {p for p in (resolved.pad_token_id, target.config.pad_token_id) if p is not None}
    pads |= set(_ids(resolved.eos_token_id)[:1])
    live = live_mask(expected.sequences, width, steps, eos, pads)
    for name in ("scores", "logits"):
        for t, step in enumerate(getattr(got, name) or ()):
            fin = ~live[:, t]
            assert not fin.any() or not bool(step[fin].abs().sum()), f"{name} step {t} finished rows not zeros"
    mine = types.SimpleNamespace(logits=got.logits if got.logits is not None else reference.logits,
                                 scores=got.scores, sequences=got.sequences)
    theirs = types.SimpleNamespace(logits=reference.logits, sequences=reference.sequences,
                                   scores=reference.scores if got.scores is not None else None)
    m = s.get("attention_mask")
    if target.config.is_encoder_decoder:
        inputs = {"input_ids": ids, **({"attention_mask": m.long()} if m is not None else {})}
        if "decoder_attention_mask" in s:
            inputs["decoder_attention_mask"] = s["decoder_attention_mask"]
    else:
        inputs = {"attention_mask": m.long()} if m is not None else {}
        if "past_key_values" in s and m is not None and not bool(m.all()):
            return  # (HF's recipe fills the cache without the mask's positions: a left pad shifts the cached
            # tokens' positions, which a teacher-forced reference does not; values compared on unpadded prompts)
    gain = processor_gain(resolved, steps)
    try:
        assert_logits_as_accurate_as_hf(target, mine, theirs, live=live, score_gain=gain, **inputs)
    except NoFloat64Reference:
        return


def hf_run(target, ids, s: dict, how: str, cache, c: dict):
    """model.generate on the draw (a copy of the prompt cache ``cache``, which generate extends in place)."""
    target.__dict__.pop("_previous_max_cache_length", None)
    s = dict(s)
    if cache is not None:
        s["past_key_values"] = copy.deepcopy(cache)
    torch.manual_seed(0)
    with quiet():
        # (a checkpoint's prompt lookup: HF's lookup refuses batches; greedy, it gives plain greedy's tokens)
        extra = {"prompt_lookup_num_tokens": None} if "prompt_lookup_num_tokens" in c.get("checkpoint", {}) else {}
        if target.config.is_encoder_decoder:  # HF's chunked prefill of an encoder-decoder slices the encoder's
            extra["prefill_chunk_size"] = None  # mask to the decoder chunk (known, test_prefill_chunks.py): unchunked
        if cache is not None:  # (transformers 5.17's chunked prefill over a prompt cache gives other tokens than
            extra["prefill_chunk_size"] = None  # its unchunked one, or fails on BLOOM; README: ours gives those)
        return call(target.generate, target, ids, s, how, extra, c)


def check(seed: int, verbose: bool = False) -> str:
    """Runs draw ``seed``: its verdict ("same", "refused: ...", "both-raise: ...", "hf-only-error: ..."), or
    AssertionError on a difference from model.generate or an exception of ours other than ValueError/TypeError."""
    c = draw(seed)
    target, draft, ids, mask, s, ours, cache, draft_config = build(c)
    if verbose:
        print(c, "\n", ids.tolist(), s, {k: getattr(v, "name_or_path", v) for k, v in ours.items()})
    try:
        expected = hf_run(target, ids, s, c["how"], cache, c)
        hf_error = None
    except Exception as e:  # noqa: BLE001
        expected, hf_error = None, e
    reference = None
    if hf_error is None and not isinstance(expected, torch.Tensor) and (s.get("output_scores")
                                                                         or s.get("output_logits")):
        reference = hf_run(target, ids, {**s, "output_scores": True, "output_logits": True}, c["how"], cache, c)
    s2 = dict(s)
    if cache is not None:
        s2["past_key_values"] = copy.deepcopy(cache)
    saved_draft_config = None
    if draft_config is not None:
        saved_draft_config = copy.deepcopy(draft.generation_config)
        draft.generation_config.num_assistant_tokens = draft_config
    target.__dict__.pop("_previous_max_cache_length", None)
    try:
        with quiet():
            got = call(functools.partial(sk.generate, target), target, ids, s2, c["how"], ours, c)
    except (ValueError, TypeError) as e:
        if hf_error is not None:
            return f"both-raise: HF {type(hf_error).__name__}: {str(hf_error)[:100]} | ours {str(e)[:160]}"
        return f"refused: {e}"
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"ours raised {type(e).__name__}: {e} (HF: {hf_error!r})\n{traceback.format_exc()}")
    finally:
        if saved_draft_config is not None:
            draft.generation_config = saved_draft_config
    def resolve(ids_, generation_config=None, **kwargs):
        for name in CALL_ONLY:
            kwargs.pop(name, None)
        return target._prepare_generation_config(generation_config, **kwargs)[0]

    with quiet():
        resolved = call(resolve, target, ids, s, c["how"], {}, c)
    if hf_error is not None:
        return f"hf-only-error: HF {type(hf_error).__name__}: {str(hf_error)[:200]}"
    compare(target, got, expected, reference, ids, {**s, **({"past_key_values": cache} if cache else {})}, resolved)
    return "same"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--compile", default=None, help="a torch.compile backend: compile=CompileOptions(backend=...)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    COMPILE_BACKEND[0] = args.compile
    tally, defects, messages = collections.Counter(), [], collections.Counter()
    began = time.time()
    for seed in range(args.start, args.start + args.cases):
        try:
            verdict = check(seed, args.verbose)
        except AssertionError as error:
            defects.append(seed)
            print(f"DEFECT seed {seed} draw {draw(seed)}\n  {error}\n", flush=True)
            continue
        except Exception as error:  # noqa: BLE001 - the draw's own setup failed (HF's probe run): say so, go on
            defects.append(seed)
            print(f"HARNESS seed {seed} {type(error).__name__}: {error}\n{traceback.format_exc()}", flush=True)
            continue
        kind = verdict.split(":")[0]
        tally[kind] += 1
        if kind != "same":
            messages[verdict[:150]] += 1
            print(seed, verdict[:300], flush=True)
    for message, count in messages.most_common():
        print(f"  {count:4d}  {message}")
    print(dict(tally), "defects:", defects, f"{time.time() - began:.0f} s", flush=True)
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
