"""Logits compared with HF's to a tolerance derived from HF's own float32 error, not tuned on one machine.

Our logits come from other computation orders than HF's (a multi-token verification forward against HF's one-token
steps, other matmul blocking on another CPU, instruction set or thread count), so they cannot be bit-identical; a
fixed atol/rtol holds on the machine it was tuned on and fails on the next. What can be required everywhere is that
they be as accurate as HF's. All are float32 evaluations of one function, whose exact value a float64 evaluation of
the same model on the same tokens gives (its own error is ~1e-9 of the float32 one's). HF's float32 error is
measured in the two orders HF itself computes these logits: its ``generate`` (one token per step, the logits
compared) and one teacher-forced forward over the whole sequence (many tokens at once, as our verification forward).
With ``e_ref`` the larger of the two maxima of ``|hf - exact|``:

* ``max |ours - exact| <= 2 e_ref``: as accurate as HF, within a factor two for the spread of a maximum of rounding
  errors over a few thousand logits (measured: ours / e_ref between 0.69 and 1.51 over the seq2seq tests, with
  ``ATEN_CPU_CAPABILITY`` avx512, avx2 and default);
* scores (processed logits: finite entries are the logits or a processor's constant): ``|ours - hf| <= 3 e_ref`` by
  the triangle inequality;
* and the reference itself well conditioned, ``e_ref <= 1e-4 max |logit|`` (measured ~1e-6 on every test model): an
  ill-conditioned test model fails here, loudly, instead of passing on one CPU and failing on another, and the
  tolerance stays far below what a wrong mask or position would change.
"""

import copy
import inspect

import torch

ILL_CONDITIONED = 1e-4  # e_ref / max |logit| above this: the test model, not the code under test, is at fault
# Encoder-decoder types whose forward over a whole decoder sequence masks or numbers it otherwise than model.generate's
# steps over a cache: FSMT (under use_cache no causal mask; without it pads masked and numbered by rank; and
# transformers 5.17's steps read one position for every token), UMT5 (transformers 5.17's decoder is not causal
# without a decoder_attention_mask): their "teacher-forced" logits are generate's steps.
STEPWISE_TYPES = ("fsmt", "umt5")


def teacher_forced_logits(model, sequences, steps: int, **inputs) -> torch.Tensor:
    """[B, steps, V] logits that predicted the last ``steps`` tokens of ``sequences`` [B, L], by one forward of
    ``model`` over ``sequences[:, :-1]``, in the model's dtype. ``inputs``: the encoder's ``input_ids`` and
    ``attention_mask`` (encoder-decoder), the prompt's ``attention_mask`` (decoder-only, left-padded) or the decoder
    prompt's ``decoder_attention_mask``; masks are extended with ones over the generated tokens, as ``generate`` does."""
    if getattr(model.config, "model_type", None) in STEPWISE_TYPES:
        return _generate_steps_logits(model, sequences, steps, **inputs)
    context = sequences[:, :-1]
    key = "decoder_attention_mask" if model.config.is_encoder_decoder else "attention_mask"
    mask = inputs.pop(key, None)
    if mask is not None:
        inputs[key] = mask = torch.cat([mask, mask.new_ones(len(mask), context.shape[1] - mask.shape[1])], dim=1)
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = context
    else:
        inputs["input_ids"] = context
        if mask is not None:  # positions of a left-padded prompt, as generate computes them
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        if model.dtype == torch.float64 and mask is not None and not model.config.is_encoder_decoder:
            # Row by row without the left padding: the same numbers in exact arithmetic. transformers' eager
            # attention in float64 turns a fully masked query (a pad position) into NaN, which every later layer
            # then spreads through 0 * NaN (Gemma 2 and BLOOM): the reference would be NaN, not exact.
            rows = []
            for row in range(len(context)):
                start = int(mask[row].nonzero()[0])
                row_inputs = {**inputs, "input_ids": context[row:row + 1, start:],
                              "attention_mask": mask[row:row + 1, start:],
                              "position_ids": inputs["position_ids"][row:row + 1, start:]}
                rows.append(model(**row_inputs).logits[:, -steps:])
            return torch.cat(rows)
        return model(**inputs).logits[:, -steps:]


def _generate_steps_logits(model, sequences, steps: int, **inputs) -> torch.Tensor:
    """[B, steps, V] as model.generate computes them for an encoder-decoder ``model``: the decoder prompt (all of
    ``sequences`` [B, L] but the last ``steps`` tokens) in one forward, then one token per forward over its cache.
    ``inputs``: the encoder's input_ids and attention_mask (a decoder_attention_mask is dropped: FSMT ignores it
    under use_cache)."""
    inputs.pop("decoder_attention_mask", None)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # (5.24 / older)
    prompt = sequences.shape[1] - steps
    with torch.no_grad():
        out = model(**inputs, decoder_input_ids=sequences[:, :prompt], use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(prompt, sequences.shape[1] - 1):
            out = model(**inputs, decoder_input_ids=sequences[:, t : t + 1], use_cache=True,
                        **{name: getattr(out, name)})
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


class NoFloat64Reference(AssertionError):
    """The model in float64 gives non-finite logits where float32 does not (T5Gemma: a padded source row's
    sliding-window layer masks every key of a pad query, the float64 mask overflows to -inf, NaN spreads through the
    next layer's attention), so there is no tolerance to derive."""


def assert_logits_as_accurate_as_hf(model, got, expected, live=None, score_gain: float = 1.0, **inputs):
    """``got``/``expected``: outputs of ``sk.generate``/``model.generate`` (float32 ``model``) with equal
    ``sequences``, and ``logits`` (``scores`` too if present). ``live`` [B, steps] bool selects the steps to compare
    (HF goes on computing finished rows). ``score_gain``: how much the logits processors behind ``scores`` can
    amplify an error in the logits (their Lipschitz constant, ``processor_gain``). ``inputs`` as for
    ``teacher_forced_logits``. Returns (ours, HF's) errors."""
    steps = len(expected.logits)
    assert len(got.logits) == steps
    live = torch.ones(len(expected.sequences), steps, dtype=torch.bool) if live is None else live
    exact = teacher_forced_logits(copy.deepcopy(model).double(), expected.sequences, steps, **inputs)[live]
    one_pass = teacher_forced_logits(model, expected.sequences, steps, **inputs)[live].double()
    theirs = torch.stack(expected.logits, dim=1)[live].double()
    mine = torch.stack(got.logits, dim=1)[live].double()
    if not bool(torch.isfinite(exact).all()) and bool(torch.isfinite(one_pass).all()):
        raise NoFloat64Reference("the model's float64 logits are not finite where its float32 ones are")
    scale = float(exact.abs().max())
    ref_error = max(float((theirs - exact).abs().max()), float((one_pass - exact).abs().max()))
    assert ref_error <= ILL_CONDITIONED * scale, (
        f"the test model is ill-conditioned: HF's float32 logits are up to {ref_error:.3g} off the float64 ones "
        f"(max |logit| {scale:.3g}), so greedy tokens and logits would depend on the CPU")
    floor = torch.finfo(torch.float32).eps * scale  # one ulp of the largest logit, should HF happen to be exact
    our_error = float((mine - exact).abs().max())
    assert our_error <= 2 * ref_error + floor, (
        f"our logits are up to {our_error:.3g} off the float64 ones, HF's {ref_error:.3g} (max |logit| {scale:.3g})")
    if expected.scores is not None:
        assert got.scores is not None and len(got.scores) == steps
        theirs, mine = torch.stack(expected.scores, dim=1)[live], torch.stack(got.scores, dim=1)[live]
        # Scores renormalised (renormalize_logits: x - logsumexp(x)) are larger than the logits and carry the
        # rounding of the logsumexp and of the subtraction: half an ulp each of the largest |score|, both sides.
        finite = theirs[torch.isfinite(theirs)]
        largest = float(finite.abs().max()) if finite.numel() else 0.0
        rounding = 2 * torch.finfo(torch.float32).eps * largest if largest > scale else 0.0
        torch.testing.assert_close(mine, theirs, rtol=0, atol=3 * ref_error * score_gain + floor + rounding)
    return our_error, ref_error


def processor_gain(config, steps: int) -> float:
    """How much HF's logits processors set in ``config`` (a resolved GenerationConfig) can multiply an error in the
    logits, over ``steps`` steps: the repetition penalties scale a logit by their penalty or its inverse, the
    exponential decay length penalty adds |logit| (factor^k - 1) to EOS's (a gain of up to factor^steps), and the
    log-softmax of ``renormalize_logits`` adds the error of the log-sum-exp (2). The others add constants or -inf."""
    gain = 1.0
    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        penalty = getattr(config, name, None)
        if penalty is not None and penalty > 0:
            gain *= max(penalty, 1 / penalty)
    decay = getattr(config, "exponential_decay_length_penalty", None)
    if decay is not None:
        gain *= max(float(decay[1]), 1.0) ** steps
    if getattr(config, "renormalize_logits", False):
        gain *= 2.0
    return gain
