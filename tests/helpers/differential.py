"""Differential testing of ``speculative_kernels.generate`` against ``model.generate`` (greedy, so token-identical).

A *case* is a seeded random combination of inputs and settings (``random_case``); ``check_case`` runs HF's
``generate`` and ours (with a draft model, and with prompt lookup) on it and returns a verdict:

* ``"same"``: ours equals HF's (sequences exactly; output classes, the presence and count of scores/logits; their
  values to the float tolerance of ``float_error.assert_logits_as_accurate_as_hf``, derived from HF's own error);
* ``"refused"``: ours raised ValueError/TypeError naming one of the settings the case varied (HF may have run);
* ``"both-raise"``: HF raised, and so did ours;
* anything else is a defect, reported with the case's arguments (``Mismatch``).

Run as a script for many random cases (``cd tests && python -m helpers.differential --cases 200``; keep it small
on a shared machine); ``tests/generation/test_differential.py`` runs a few fixed seeds.
"""

import contextlib
import copy
import functools
import logging
import random
import sys
import warnings

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import MaxLengthCriteria, RepetitionPenaltyLogitsProcessor

import speculative_kernels as sk

from helpers.float_error import NoFloat64Reference, assert_logits_as_accurate_as_hf, processor_gain

PAD, BOS, EOS = 0, 1, 2  # helpers.models.SPECIAL
VOCAB = 97


class Mismatch(AssertionError):
    pass


@contextlib.contextmanager
def quiet():
    """HF's warnings and log lines about odd settings, which the cases make on purpose."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def assert_same_output_form(got, expected) -> bool:
    """AssertionError where ``got`` (ours) and ``expected`` (HF's ``generate`` output) differ in kind, sequences, or
    the presence, count, shapes and dtypes of scores/logits. True when there is nothing more to compare (a tensor
    result, or neither scores nor logits): the values are left to the caller (their float error)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"HF returned a tensor, ours {type(got).__name__}"
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected), (
            f"sequences differ:\n  HF   {expected.tolist()}\n  ours {got.tolist()}")
        return True
    assert isinstance(got, type(expected)), f"HF returned {type(expected).__name__}, ours {type(got).__name__}"
    assert got.sequences.shape == expected.sequences.shape and torch.equal(got.sequences, expected.sequences), (
        f"sequences differ:\n  HF   {expected.sequences.tolist()}\n  ours {got.sequences.tolist()}")
    for name in ("scores", "logits"):
        theirs, mine = getattr(expected, name), getattr(got, name)
        assert (theirs is None) == (mine is None), f"{name}: HF {theirs is None}, ours {mine is None}"
        if theirs is not None:
            assert len(theirs) == len(mine) and all(a.shape == b.shape and a.dtype == b.dtype
                                                    for a, b in zip(theirs, mine)), (
                f"{name}: HF {[tuple(t.shape) for t in theirs]}, ours {[tuple(t.shape) for t in mine]}")
    return expected.scores is None and expected.logits is None


def _prompt(rng: random.Random, batch: int, special: bool):
    """Left-padded prompts [batch, L] (pad id PAD on the left) and their mask; with ``special``, pad/bos/eos ids
    inside the prompts."""
    lengths = [rng.randint(2, 7) for _ in range(batch)]
    width = max(lengths)
    ids = torch.full((batch, width), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        tokens = [rng.randrange(3, VOCAB) for _ in range(length)]
        if special:
            for _ in range(rng.randint(1, 2)):
                tokens[rng.randrange(length)] = rng.choice([PAD, BOS, EOS])
            tokens[-1] = tokens[-1] if tokens[-1] != PAD else rng.randrange(3, VOCAB)  # no right padding
        ids[row, width - length:] = torch.tensor(tokens)
        mask[row, width - length:] = 1
    return ids, mask


EXTRAS = [
    {}, {}, {}, {},
    {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"bad_words_ids": [[5], [7, 8]]},
    {"suppress_tokens": [5, 6]}, {"begin_suppress_tokens": [5]}, {"forced_bos_token_id": 9},
    {"forced_eos_token_id": 11}, {"forced_eos_token_id": [11, 12]}, {"sequence_bias": {(5,): -3.0}},
    {"min_p": 0.1}, {"typical_p": 0.9}, {"epsilon_cutoff": 3e-4}, {"renormalize_logits": True},
    {"length_penalty": 2.0}, {"early_stopping": True}, {"output_attentions": True}, {"output_hidden_states": True},
    {"use_cache": False}, {"use_cache": True}, {"num_return_sequences": 2}, {"num_beams": 1},
    {"max_time": 100.0}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.5},
    {"logits_processor": "repetition"}, {"logits_processor": "empty"}, {"stopping_criteria": "max_length"},
    {"stopping_criteria": "empty"}, {"remove_invalid_values": True}, {"exponential_decay_length_penalty": (2, 1.5)},
    {"encoder_repetition_penalty": 1.2}, {"encoder_no_repeat_ngram_size": 2}, {"bos_token_id": 7},
    {"forced_bos_token_id": 9, "bos_token_id": 7}, {"num_assistant_tokens": 2}, {"max_matching_ngram_size": 1},
    {"cache_implementation": "static"}, {"cache_implementation": "dynamic"}, {"do_sample": None},
    {"guidance_scale": 1.0}, {"decoder_start_token_id": 5}, {"token_healing": False}, {"stop_strings": "ab"},
    {"watermarking_config": {"bias": 3.0}}, {"watermarking_config": {"bias": 3.0, "seeding_scheme": "selfhash"}},
    {"cache_implementation": "sliding_window"}, {"num_beam_groups": 2, "diversity_penalty": 0.5}, {"low_memory": True},
]


def random_case(seed: int) -> dict:
    """A seeded random decoder-only case: {"ids", "mask" (or None), "how" (kwargs|config|model_config),
    "settings": {name: value}}."""
    rng = random.Random(seed)
    batch = rng.choice([1, 1, 3])
    special = rng.random() < 0.4
    ids, mask = _prompt(rng, batch, special)
    give_mask = rng.random() < 0.6
    case = {"seed": seed, "ids": ids, "mask": mask if give_mask else None, "settings": {}}
    s = case["settings"]
    s["do_sample"] = False
    eos_choice = rng.choice(["config", "int", "list", "none", "frequent", "frequent-list"])
    if eos_choice == "int":
        s["eos_token_id"] = EOS
    elif eos_choice == "list":
        s["eos_token_id"] = [EOS, rng.randrange(3, VOCAB)]
        if rng.random() < 0.3:
            s["eos_token_id"] = torch.tensor(s["eos_token_id"])
    elif eos_choice == "none":
        s["eos_token_id"] = None
    elif eos_choice.startswith("frequent"):
        s["eos_token_id"] = "frequent" if eos_choice == "frequent" else ["frequent", EOS]
    pad_choice = rng.choice(["config", "config", "other", "eos", "none"])
    if pad_choice == "other":
        s["pad_token_id"] = 4
    elif pad_choice == "eos":
        s["pad_token_id"] = "eos"
    elif pad_choice == "none":
        s["pad_token_id"] = None
    length = rng.choice(["new", "new", "max_length", "both", "default"])
    if length in ("new", "both"):
        s["max_new_tokens"] = rng.randint(1, 12)
    if length in ("max_length", "both"):
        s["max_length"] = ids.shape[1] + rng.randint(-1, 12)  # no longer than the prompt: HF refuses
    if rng.random() < 0.15:  # fractional lengths, as model.generate takes them
        for name in ("max_new_tokens", "max_length"):
            if name in s:
                s[name] += 0.5
    minimum = rng.choice([None, None, "min_new_tokens", "min_length", "both"])
    if minimum in ("min_new_tokens", "both"):
        s["min_new_tokens"] = rng.randint(0, 8)
    if minimum in ("min_length", "both"):
        s["min_length"] = ids.shape[1] + rng.randint(-2, 10)
    output = rng.choice(["tensor", "tensor", "dict", "scores", "logits", "both"])
    if output != "tensor":
        s["return_dict_in_generate"] = True
        s["output_scores"] = output in ("scores", "both")
        s["output_logits"] = output in ("logits", "both")
    extra = rng.choice(EXTRAS)
    s.update(extra)
    case["how"] = rng.choice(["kwargs", "kwargs", "config", "model_config", "split"])
    if rng.random() < 0.1:
        case["ending"] = rng.choice(["eos", "none", "empty"])
    case["pass_ids"] = rng.choice(["positional", "positional", "inputs", "input_ids", "int32"])
    if rng.random() < 0.3:  # two settings of EXTRAS together (drawn last: the draws above stay as they were)
        s.update(rng.choice(EXTRAS))
    return case


SEQ2SEQ_EXTRAS = EXTRAS + [{"forced_bos_token_id": None}, {"forced_bos_token_id": 9}, {"decoder_start_token_id": 5},
                           {"bos_token_id": 7}]


def random_seq2seq_case(seed: int, family: str) -> dict:
    """A seeded random encoder-decoder case for ``family`` (its ids from ``seq2seq_models.special_ids``; e.g. "t5":
    pad 0, eos 1, start 0; "bart": bos 0, pad 1, eos 2, start 2, forced_bos 0): right-padded sources, with or
    without a mask, decoder_input_ids (with or without the start token), encoder_outputs, and the decoder-only
    case's settings."""
    from helpers.seq2seq_models import special_ids

    rng = random.Random(seed)
    pad, eos, start = special_ids(family)
    batch = rng.choice([1, 1, 3])
    lengths = [rng.randint(2, 8) for _ in range(batch)]
    ids = torch.full((batch, max(lengths)), pad, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.tensor([rng.randrange(3, VOCAB) for _ in range(length)])
        mask[row, :length] = 1
    case = {"seed": seed, "family": family, "ids": ids, "mask": mask if rng.random() < 0.7 else None,
            "settings": {"do_sample": False},
            "how": rng.choice(["kwargs", "kwargs", "config", "model_config", "split"])}
    s = case["settings"]
    decoder = rng.choice([None, None, None, "with_start", "without_start", "encoder_outputs"])
    if decoder in ("with_start", "without_start"):
        tokens = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 3))]] * batch)
        if decoder == "with_start":
            tokens = torch.cat([torch.full((batch, 1), start), tokens], dim=1)
        case["decoder_input_ids"] = tokens
    elif decoder == "encoder_outputs":
        case["encoder_outputs"] = True
    eos_choice = rng.choice(["config", "int", "list", "none", "frequent"])
    if eos_choice == "int":
        s["eos_token_id"] = eos
    elif eos_choice == "list":
        s["eos_token_id"] = [eos, rng.randrange(3, VOCAB)]
    elif eos_choice == "none":
        s["eos_token_id"] = None
    elif eos_choice == "frequent":
        s["eos_token_id"] = "frequent"
    pad_choice = rng.choice(["config", "config", "other", "none"])
    if pad_choice == "other":
        s["pad_token_id"] = 4
    elif pad_choice == "none":
        s["pad_token_id"] = None
    length = rng.choice(["new", "new", "max_length", "both", "default"])
    if length in ("new", "both"):
        s["max_new_tokens"] = rng.randint(1, 10)
    if length in ("max_length", "both"):
        s["max_length"] = rng.randint(3, 12)
    minimum = rng.choice([None, None, "min_new_tokens", "min_length", "both"])
    if minimum in ("min_new_tokens", "both"):
        s["min_new_tokens"] = rng.randint(0, 6)
    if minimum in ("min_length", "both"):
        s["min_length"] = rng.randint(0, 10)
    output = rng.choice(["tensor", "tensor", "dict", "scores", "logits", "both"])
    if output != "tensor":
        s["return_dict_in_generate"] = True
        s["output_scores"] = output in ("scores", "both")
        s["output_logits"] = output in ("logits", "both")
    s.update(rng.choice(SEQ2SEQ_EXTRAS))
    if rng.random() < 0.3:  # two settings together (drawn last: the draws above stay as they were)
        s.update(rng.choice(SEQ2SEQ_EXTRAS))
    return case


def _materialise(case: dict, target) -> tuple[torch.Tensor | None, dict]:
    """Resolve the case's symbolic values ("frequent": a token HF's plain greedy run emits mid-way, so that EOS
    stops a row; "eos"; the processor and criteria lists) into generate arguments."""
    ids, mask = case["ids"].clone(), case["mask"]
    settings = dict(case["settings"])
    ending = case.get("ending")
    if ending == "eos":
        ids[:, -1] = EOS
    if ending in ("none", "empty"):
        ids, mask = (None, None) if ending == "none" else (ids[:, :0], None)
    if "frequent" in repr(settings.get("eos_token_id")):
        probe = ids if ids is not None and ids.shape[1] else torch.full((1, 1), BOS)
        probe_mask = mask if ids is not None and ids.shape[1] else None
        with quiet():
            plain = target.generate(probe, attention_mask=probe_mask, max_new_tokens=8, do_sample=False,
                                    eos_token_id=None, pad_token_id=PAD)
        width = 1 if target.config.is_encoder_decoder else probe.shape[1]
        new = plain[0, width:].tolist()
        token = new[min(3, len(new) - 1)]
        value = settings["eos_token_id"]
        settings["eos_token_id"] = token if value == "frequent" else [token, EOS]
    if settings.get("pad_token_id") == "eos":
        eos = settings.get("eos_token_id", EOS)
        settings["pad_token_id"] = int(torch.as_tensor(eos).flatten()[0]) if eos is not None else EOS
    processor = settings.pop("logits_processor", None)
    if processor is not None:
        settings["logits_processor"] = LogitsProcessorList(
            [RepetitionPenaltyLogitsProcessor(1.3)] if processor == "repetition" else [])
    criteria = settings.pop("stopping_criteria", None)
    if criteria is not None:
        settings["stopping_criteria"] = StoppingCriteriaList(
            [MaxLengthCriteria(max_length=(0 if ids is None else ids.shape[1]) + 3)] if criteria == "max_length"
            else [])
    if case.get("decoder_input_ids") is not None:
        settings["decoder_input_ids"] = case["decoder_input_ids"]
    if case.get("encoder_outputs"):
        with torch.no_grad():
            settings["encoder_outputs"] = target.get_encoder()(input_ids=ids, attention_mask=mask, return_dict=True)
        if case["seed"] % 2:  # encoder_outputs alone, as HF allows
            ids = None
    return ids, mask, settings


CALL_ONLY = ("logits_processor", "stopping_criteria", "decoder_input_ids", "encoder_outputs")  # not config fields


def _call(generate, target, ids, mask, settings, how, pass_ids="positional", **extra):
    """Call ``generate`` with the settings passed as keywords, in a GenerationConfig, or by mutating
    target.generation_config (restored afterwards)."""
    kwargs = {k: v for k, v in settings.items() if k in CALL_ONLY}
    fields = {k: v for k, v in settings.items() if k not in CALL_ONLY}
    if mask is not None:
        kwargs["attention_mask"] = mask
    if pass_ids == "int32" and ids is not None:
        ids = ids.to(torch.int32)
    if pass_ids in ("inputs", "input_ids"):
        kwargs[pass_ids] = ids
    else:
        generate = functools.partial(generate, ids)
    if how == "kwargs":
        return generate(**kwargs, **fields, **extra)
    if how == "config":
        config = copy.deepcopy(target.generation_config)
        for name, value in fields.items():
            setattr(config, name, value)
        return generate(generation_config=config, **kwargs, **extra)
    if how == "split":  # every other field in a fresh GenerationConfig, the rest as keywords (which win)
        names = sorted(fields)
        config = GenerationConfig(**{name: fields[name] for name in names[::2]})
        return generate(generation_config=config, **kwargs, **{name: fields[name] for name in names[1::2]},
                        **extra)
    saved = copy.deepcopy(target.generation_config)
    try:
        for name, value in fields.items():
            setattr(target.generation_config, name, value)
        return generate(**kwargs, **extra)
    finally:
        target.generation_config = saved


def _live(sequences, prompt_width: int, steps: int, eos) -> torch.Tensor:
    """[B, steps] bool: the steps at which a row had not yet emitted an EOS id (HF computes finished rows on)."""
    eos = set([] if eos is None else [eos] if isinstance(eos, int) else torch.as_tensor(eos).flatten().tolist())
    new = sequences[:, prompt_width:prompt_width + steps]
    ended = torch.zeros_like(new, dtype=torch.bool)
    for e in eos:
        ended |= new == e
    before = torch.cumsum(ended.long(), dim=1) - ended.long()
    return before == 0


def _compare_outputs(target, got, expected, ids, mask, resolved, reference):
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"HF returned a tensor, ours {type(got).__name__}")
        if got.shape != expected.shape or not torch.equal(got, expected):
            raise Mismatch(f"sequences differ:\nHF   {expected.tolist()}\nours {got.tolist()}")
        return
    if isinstance(got, torch.Tensor):
        raise Mismatch(f"HF returned {type(expected).__name__}, ours a tensor")
    if not isinstance(got, type(expected)):  # ours subclass HF's output classes
        raise Mismatch(f"HF returned {type(expected).__name__}, ours {type(got).__name__}")
    if got.sequences.shape != expected.sequences.shape or not torch.equal(got.sequences, expected.sequences):
        raise Mismatch(f"sequences differ:\nHF   {expected.sequences.tolist()}\nours {got.sequences.tolist()}")
    for name in ("scores", "logits", "attentions", "hidden_states"):
        theirs, mine = getattr(expected, name, None), getattr(got, name, None)
        if (theirs is None) != (mine is None):
            raise Mismatch(f"{name}: HF {'None' if theirs is None else len(theirs)}, ours "
                           f"{'None' if mine is None else len(mine)}")
        if theirs is not None and name in ("scores", "logits"):
            if len(theirs) != len(mine) or any(a.shape != b.shape for a, b in zip(theirs, mine)):
                raise Mismatch(f"{name}: HF {[tuple(t.shape) for t in theirs]}, ours {[tuple(t.shape) for t in mine]}")
    if expected.scores is None and expected.logits is None:
        return
    # values: against HF's float32 error (reference: HF's output with both scores and logits)
    steps = len(reference.logits)
    width = expected.sequences.shape[1] - steps
    live = _live(expected.sequences, width, steps, resolved.eos_token_id)

    class Both:
        pass

    mine, theirs = Both(), Both()
    mine.logits = got.logits if got.logits is not None else None
    if mine.logits is None:  # scores only: compared against HF's, with the tolerance from HF's logits
        mine.logits = reference.logits
    mine.scores, mine.sequences = got.scores, got.sequences
    theirs.logits, theirs.sequences = reference.logits, reference.sequences
    theirs.scores = reference.scores if got.scores is not None else None
    if target.config.is_encoder_decoder:
        if ids is None:  # encoder_outputs alone: no float64 reference to derive a tolerance from; shapes only
            return
        inputs = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
    elif mask is None and ids is not None:  # HF's inferred mask (``_prepare_attention_mask_for_generation``)
        eos = resolved.eos_token_id
        eos = set([] if eos is None else [eos] if isinstance(eos, int) else torch.as_tensor(eos).flatten().tolist())
        pad = resolved.pad_token_id if resolved.pad_token_id is not None else next(iter(eos), None)
        if pad is not None and pad not in eos and bool((ids == pad).any()):
            mask = (ids != pad).long()
    if not target.config.is_encoder_decoder:
        inputs = {} if mask is None else {"attention_mask": mask}
    try:
        assert_logits_as_accurate_as_hf(target, mine, theirs, live=live,
                                        score_gain=processor_gain(resolved, steps), **inputs)
    except NoFloat64Reference:  # shapes only, as for encoder_outputs alone
        return
    except AssertionError as error:
        raise Mismatch(f"score/logit values: {error}") from None


def _named(error: Exception, settings: dict) -> bool:
    message = str(error)
    return any(name in message for name in settings) or "input_ids" in message or "attention_mask" in message


def _hf_scores_invalid(target, ids, mask, settings, how) -> bool:
    """Whether model.generate's own processed scores hold NaN or +inf (e.g. transformers 5.17's
    exponential_decay_length_penalty over a forced EOS's -inf: HF emits the NaN entry's token; ours refuses such
    logits naming target_logits, as the README's differences table says)."""
    with quiet():
        out = _call(target.generate, target, ids, mask,
                    {**settings, "return_dict_in_generate": True, "output_scores": True}, how)
    return any(bool((score.isnan() | (score == float("inf"))).any()) for score in out.scores)


def _via_session(target, *args, inputs=None, input_ids=None, draft_model=None, num_speculative_tokens=None,
                 prompt_lookup_num_tokens=None, **kwargs):
    """``generate``'s call run as ``SpeculativeDecoder(...).start(...)`` stepped to the end: its sequences (the
    session has no dict output; such cases are refused by name, as for any setting ``start`` does not take)."""
    ids = args[0] if args else inputs if inputs is not None else input_ids
    decoder = sk.SpeculativeDecoder(target, draft_model, num_speculative_tokens=num_speculative_tokens,
                                    prompt_lookup_num_tokens=prompt_lookup_num_tokens)
    session = decoder.start(ids, **kwargs)
    while not session.finished:
        session.step()
    return session.sequences()


STATIC_NAMES = ("static", "sliding_window", "hybrid_chunked")  # (transformers' names of its static cache)


def _reference_settings(target, settings: dict) -> dict:
    """The settings model.generate's reference run takes: the case's, but the dynamic cache for FSMT in place of the
    static one. transformers' FSMT ``Attention`` attends every slot of a ``StaticCache``, its unwritten zeros too (it
    adds no mask over the cache), so ``model.generate(cache_implementation="static")`` gives other logits from the
    first step (1.6 to 2.9 off its dynamic cache's on the harness's model, other tokens; 5.17 and 5.24); ours gives the
    model's own (README, "Where we are stricter")."""
    if type(target).__name__ == "FSMTForConditionalGeneration" and settings.get("cache_implementation") in STATIC_NAMES:
        return {**settings, "cache_implementation": "dynamic"}
    return settings


def check_case(case: dict, target, draft, session: bool = False) -> dict:
    """{drafting: verdict} for drafting in ("draft_model", "prompt_lookup"), and with ``session`` the same two
    through ``SpeculativeDecoder.start()`` ("session/..."); raises Mismatch on a defect."""
    ids, mask, settings = _materialise(case, target)
    hf_settings = _reference_settings(target, settings)
    how, pass_ids = case["how"], case.get("pass_ids", "positional")
    verdicts = {}
    hf_error = None
    # HF keeps a static cache's size between calls (a float after a fractional length, which then breaks every later
    # static-cache call of the model): each case starts from a fresh model state.
    target.__dict__.pop("_previous_max_cache_length", None)
    with quiet():
        try:
            torch.manual_seed(0)
            expected = _call(target.generate, target, ids, mask, hf_settings, how, pass_ids)
        except Exception as error:  # noqa: BLE001 - HF refusing is an outcome
            hf_error = error
    def resolve(input_ids=None, generation_config=None, **kwargs):  # the merged config HF's generate works from
        for name in ("attention_mask", "inputs", "input_ids", *CALL_ONLY):
            kwargs.pop(name, None)
        return target._prepare_generation_config(generation_config, **kwargs)[0]

    try:
        with quiet():
            resolved = _call(resolve, target, ids, mask, settings, how)
    except Exception:  # noqa: BLE001 - HF refuses the settings themselves (HF's run below raises too)
        resolved = None
    reference = None
    if hf_error is None and not isinstance(expected, torch.Tensor) and (settings.get("output_scores")
                                                                         or settings.get("output_logits")):
        with quiet():
            reference = _call(target.generate, target, ids, mask,
                              {**hf_settings, "output_scores": True, "output_logits": True}, how)
    gamma = (1, 2, 3, 3, 5, "auto")[case["seed"] % 6]
    paths = [("draft_model", {"draft_model": draft, "num_speculative_tokens": gamma}),
             ("prompt_lookup", {"prompt_lookup_num_tokens": 3})]
    if session:
        paths += [(f"session/{name}", extra) for name, extra in paths]
    for drafting, extra in paths:
        def ours(*args, **kwargs):
            if drafting.startswith("session/"):
                return _via_session(target, *args, **kwargs)
            return sk.generate(target, *args, **kwargs)
        try:
            with quiet():
                got = _call(ours, target, ids, mask, settings, how, pass_ids, **extra)
        except (ValueError, TypeError) as error:
            if hf_error is not None:
                verdicts[drafting] = "both-raise"
                continue
            if "target_logits" in str(error) and _hf_scores_invalid(target, ids, mask, hf_settings, how):
                verdicts[drafting] = "both-invalid"  # (README: NaN/+inf logits are refused by name, HF emits them)
                continue
            if not _named(error, settings):
                raise Mismatch(f"[{drafting}] ours raised without naming a setting: {error!r}") from None
            verdicts[drafting] = f"refused: {error}"
            continue
        except Exception as error:  # noqa: BLE001
            raise Mismatch(f"[{drafting}] ours raised {type(error).__name__}: {error} (HF: {hf_error!r})") from None
        if hf_error is not None and not isinstance(hf_error, (ValueError, TypeError)) and case.get("ending") == "empty":
            verdicts[drafting] = f"extension: HF crashed ({hf_error!r}) on an empty prompt, ours starts from BOS"
            continue
        if isinstance(hf_error, TypeError) and "but got float" in str(hf_error) and \
                settings.get("cache_implementation") in ("static", "sliding_window"):  # (HF's static cache both)
            verdicts[drafting] = f"extension: HF's static cache cannot be sized for a fractional length ({hf_error!r})"
            continue
        if hf_error is not None:
            returned = got if isinstance(got, torch.Tensor) else type(got).__name__
            raise Mismatch(f"[{drafting}] HF raised {hf_error!r}, ours returned {returned}")
        if drafting.startswith("session/") and not isinstance(expected, torch.Tensor):
            expected = expected.sequences  # (the model's own return_dict_in_generate: a session returns token ids)
        try:
            _compare_outputs(target, got, expected, ids, mask, resolved, reference)
        except Mismatch as error:
            raise Mismatch(f"[{drafting}] {error}") from None
        verdicts[drafting] = "same"
    return verdicts


def describe(case: dict) -> str:
    ids = case["ids"].tolist()
    mask = None if case["mask"] is None else case["mask"].tolist()
    return (f"family={case.get('family', 'llama')} seed={case['seed']} how={case['how']} "
            f"decoder_input_ids={case.get('decoder_input_ids')} encoder_outputs={case.get('encoder_outputs')} "
            f" ending={case.get('ending')} pass_ids={case.get('pass_ids')} ids={ids} mask={mask} "
            f"settings={case['settings']}")


def models(family: str):
    """(target, draft) of the harness for ``family``: a decoder-only family or one of ``ALL_SEQ2SEQ_FAMILIES``
    (tiny, random, built here)."""
    from helpers.models import decoder_only_families

    decoder_only = decoder_only_families()
    if family in decoder_only:
        return decoder_only[family](), decoder_only[family](layers=1, seed=3)
    from helpers.seq2seq_models import ALL_SEQ2SEQ_FAMILIES

    make = ALL_SEQ2SEQ_FAMILIES[family]
    return make(), make(layers=1, seed=3)


def main(argv=None) -> int:
    import argparse
    import collections

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--session", action="store_true", help="also run each case through SpeculativeDecoder.start()")
    from helpers.models import decoder_only_families
    from helpers.seq2seq_models import ALL_SEQ2SEQ_FAMILIES

    decoder_only = list(decoder_only_families())
    parser.add_argument("--family", choices=[*decoder_only, *ALL_SEQ2SEQ_FAMILIES], default="llama")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target, draft = models(args.family)
    tally, failures = collections.Counter(), []
    for seed in range(args.start, args.start + args.cases):
        case = random_case(seed) if args.family in decoder_only else random_seq2seq_case(seed, args.family)
        try:
            verdicts = check_case(case, target, draft, session=args.session)
        except Mismatch as error:
            failures.append(seed)
            print(f"DEFECT {describe(case)}\n  {error}\n", flush=True)
            continue
        for drafting, verdict in verdicts.items():
            tally[verdict.split(":")[0]] += 1
            if args.verbose or verdict.startswith("refused"):
                print(f"{seed} {drafting}: {verdict[:160]}  | {case['settings']}", flush=True)
    print(dict(tally), "defects:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
