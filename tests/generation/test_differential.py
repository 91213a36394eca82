"""Differences from ``model.generate`` found by the differential harness (``helpers/differential.py``), each pinned
by a test that fails on the code before its fix, and a fixed-seed sweep of the harness itself (greedy: ours must
equal HF's token for token, or refuse by name)."""

import warnings

import pytest
import torch

import speculative_kernels as sk
from helpers.differential import Mismatch, check_case, describe, models, random_case, random_seq2seq_case
from helpers.models import VOCAB, hf_generate, llama


@pytest.fixture(scope="module")
def pair():
    return llama(), llama(layers=1, seed=3)


def _eos_after(model, ids, steps: int) -> int:
    """A token HF's plain greedy run emits as its ``steps``-th new token (0-based): an EOS id that stops it there."""
    plain = hf_generate(model, ids, max_new_tokens=steps + 1, do_sample=False, eos_token_id=None, pad_token_id=0)
    return int(plain[0, ids.shape[1] + steps])


def test_min_new_tokens_takes_precedence_over_min_length(pair):
    """HF (``_prepare_generated_length``): when min_new_tokens is set, min_length is overwritten with
    min_new_tokens + prompt length, so a larger min_length changes nothing; we took the larger of the two."""
    target, draft = pair
    ids = torch.tensor([[84, 39, 64, 30, 63]])
    eos = _eos_after(target, ids, 3)
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0, min_new_tokens=3)
    expected = hf_generate(target, ids, min_length=15, **kwargs)
    assert expected.shape[1] == ids.shape[1] + 4  # stops at the EOS, min_length ignored
    assert not torch.equal(expected, hf_generate(target, ids, **{**kwargs, "min_new_tokens": 10}))  # the test can fail
    for extra in (dict(draft_model=draft, num_speculative_tokens=3), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(sk.generate(target, ids, min_length=15, **kwargs, **extra), expected)
    # min_new_tokens=0 set: still takes precedence (no minimum), as in HF
    zero = dict(kwargs, min_new_tokens=0)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, min_length=15, **zero),
                       hf_generate(target, ids, min_length=15, **zero))


@pytest.mark.parametrize("length", [dict(max_new_tokens=1), dict(max_length=6)])
@pytest.mark.parametrize("drafting", ["prompt_lookup", "ngram"])
def test_one_new_token_without_a_draft_model(pair, length, drafting):
    """One new token: the loop runs the target on the prompt and never starts the drafter; a drafter without a
    model was still asked to observe the step and failed (AttributeError on its missing context)."""
    target, _ = pair
    ids = torch.tensor([[86, 9, 12, 71, 15]])
    extra = dict(prompt_lookup_num_tokens=3) if drafting == "prompt_lookup" else dict(
        drafter=sk.NGramDrafter(VOCAB))
    kwargs = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, **length)
    expected = hf_generate(target, ids, **kwargs)
    got = sk.generate(target, ids, **kwargs, **extra)
    assert torch.equal(got.sequences, expected.sequences) and len(got.scores) == 1


SWEEP = range(0, 60)


def test_differential_sweep(pair):
    """Random seeded cases (inputs, settings, how they are passed) against HF; any outcome but "same" or a refusal
    naming a setting fails, with the case to reproduce it (``cd tests && python -m helpers.differential``)."""
    target, draft = pair
    verdicts, failures = [], []
    for seed in SWEEP:
        case = random_case(seed)
        try:
            verdicts += check_case(case, target, draft).values()
        except Mismatch as error:
            failures.append(f"{describe(case)}\n  {error}")
    assert not failures, "\n\n".join(failures)
    assert sum(v == "same" for v in verdicts) >= len(verdicts) // 4  # the sweep does compare outputs


def test_fsmt_static_cache_reference_is_its_dynamic_cache():
    """transformers' FSMT attends every slot of a static cache, its unwritten zeros too: model.generate with
    cache_implementation="static" gives other tokens than with its dynamic cache (5.17, 5.24), and the harness took
    them as the reference (seed 52002 of ``--family fsmt``). Ours gives the model's own tokens, its dynamic cache's
    (README, "Where we are stricter"), which the harness now compares with."""
    target, draft = models("fsmt")
    ids = torch.tensor([[34, 85, 83, 8, 86]])
    kwargs = dict(do_sample=False, eos_token_id=None, max_new_tokens=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        static = target.generate(ids, cache_implementation="static", **kwargs)
        dynamic = target.generate(ids, **kwargs)
    assert not torch.equal(static, dynamic)  # (HF's static cache still differs: the case below can fail)
    case = {"seed": 0, "ids": ids, "mask": None, "how": "kwargs",
            "settings": {**kwargs, "cache_implementation": "static"}}
    assert check_case(case, target, draft) == {"draft_model": "same", "prompt_lookup": "same"}


def test_a_builtin_stopping_criterion_replaces_hf_own(pair):
    """HF's ``_merge_criteria_processor_list``: a MaxLengthCriteria / EosTokenCriteria in stopping_criteria replaces
    generate's own, so HF ran past max_length (or ignored eos_token_id) where we stopped: silently fewer tokens.
    Same outcome where it stops no later; refused by name where it would not."""
    from transformers import StoppingCriteriaList
    from transformers.generation import EosTokenCriteria, MaxLengthCriteria

    target, draft = pair
    ids = torch.tensor([[16, 38, 45, 85, 72, 93]])
    kwargs = dict(do_sample=False, max_length=7)
    longer = StoppingCriteriaList([MaxLengthCriteria(max_length=9)])
    assert hf_generate(target, ids, stopping_criteria=longer, **kwargs).shape[1] == 9  # HF goes past max_length=7
    with pytest.raises(ValueError, match=r"stopping_criteria holds a MaxLengthCriteria\(max_length=9\)"):
        sk.generate(target, ids, draft_model=draft, stopping_criteria=longer, **kwargs)
    shorter = dict(do_sample=False, max_new_tokens=8, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(9)]))
    assert torch.equal(sk.generate(target, ids, draft_model=draft, **shorter), hf_generate(target, ids, **shorter))

    eos = _eos_after(target, ids, 2)
    other = StoppingCriteriaList([EosTokenCriteria(eos_token_id=eos)])
    kwargs = dict(do_sample=False, max_new_tokens=8, eos_token_id=[97 - 1])
    assert hf_generate(target, ids, stopping_criteria=other, **kwargs).shape[1] == ids.shape[1] + 3  # stops at its ids
    with pytest.raises(ValueError, match="stopping_criteria holds an EosTokenCriteria"):
        sk.generate(target, ids, draft_model=draft, stopping_criteria=other, **kwargs)
    same = dict(kwargs, eos_token_id=eos, stopping_criteria=other)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, **same), hf_generate(target, ids, **same))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_differential_sweep_seq2seq(family):
    """The same for encoder-decoder pairs: decoder_input_ids with and without the start token, encoder_outputs
    (with and without input_ids), forced BOS/EOS, decoder_start_token_id, as keywords or configs."""
    _sweep_seq2seq(family, seeds=30)


def _sweep_seq2seq(family: str, seeds: int) -> None:
    """``random_seq2seq_case`` seeds 0..seeds-1 of ``family`` against model.generate: no mismatch, and at least a
    quarter of the verdicts "same" (not all refused)."""
    target, draft = models(family)
    verdicts, failures = [], []
    for seed in range(seeds):
        case = random_seq2seq_case(seed, family)
        try:
            verdicts += check_case(case, target, draft).values()
        except Mismatch as error:
            failures.append(f"{describe(case)}\n  {error}")
    assert not failures, "\n\n".join(failures)
    assert sum(v == "same" for v in verdicts) >= len(verdicts) // 4


def test_no_input_ids_takes_the_batch_size_from_the_attention_mask(pair):
    """HF (``_maybe_initialize_input_ids_for_generation``): without input_ids, one BOS per row of the first tensor
    keyword (the attention_mask); we started a single row."""
    target, draft = pair
    mask = torch.ones(2, 1, dtype=torch.long)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    expected = hf_generate(target, None, **kwargs)
    assert expected.shape == (2, 5)
    for extra in (dict(draft_model=draft), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(sk.generate(target, **kwargs, **extra), expected)
    with pytest.raises(ValueError, match=r"attention_mask without input_ids must be \[batch, 1\] ones"):
        sk.generate(target, draft_model=draft, attention_mask=torch.ones(2, 3, dtype=torch.long), max_new_tokens=4)


@pytest.mark.parametrize("drafting", ["draft_model", "prompt_lookup"])
def test_a_batch_without_pad_or_eos_runs_as_inhf_generate(pair, drafting):
    """No eos_token_id and no pad_token_id: no row can finish early, nothing is padded, and HF generates the batch;
    we refused it (pad_token_id needed)."""
    target, draft = pair
    ids = torch.tensor([[0, 0, 5, 17, 42], [3, 9, 17, 42, 70]])
    kwargs = dict(attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), max_new_tokens=7,
                  do_sample=False, eos_token_id=None, pad_token_id=None)
    extra = dict(draft_model=draft, num_speculative_tokens=3) if drafting == "draft_model" else dict(
        prompt_lookup_num_tokens=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target.generation_config.eos_token_id, saved = None, target.generation_config.eos_token_id
        try:
            expected = hf_generate(target, ids, **kwargs)
            got = sk.generate(target, ids, **kwargs, **extra)
        finally:
            target.generation_config.eos_token_id = saved
    assert torch.equal(got, expected)


@pytest.mark.parametrize("length", [dict(max_new_tokens=5.5), dict(max_length=10.5)])
def test_forced_eos_with_a_fractional_length(pair, length):
    """HF's ForcedEOSTokenLogitsProcessor forces at length == max_length - 1, never true for a fractional max_length
    (max_new_tokens=5.5 generates 6 tokens, none forced); we forced the last one."""
    target, draft = pair
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    kwargs = dict(do_sample=False, forced_eos_token_id=11, **length)
    expected = hf_generate(target, ids, **kwargs)
    assert expected.shape[1] == 11 and expected[0, -1] != 11  # 6 new tokens, the last not forced
    assert torch.equal(sk.generate(target, ids, draft_model=draft, **kwargs), expected)
    whole = {**kwargs, **{k: 6 if k == "max_new_tokens" else 11 for k in length}}  # the integral lengths
    assert torch.equal(sk.generate(target, ids, draft_model=draft, **whole), hf_generate(target, ids, **whole))


@pytest.mark.parametrize("family,seeds", [("llama", 6), ("t5", 3), ("bart", 3)])
def test_sampling_differential_sweep(family, seeds):
    """Random processor, warper and EOS settings with each drafter, two prompts (one padded): every prompt's
    continuations follow HF's own chain for that row (``helpers/sampling_differential.py``; 120 seeds of the
    decoder-only model and 40 of each encoder-decoder run clean)."""
    from helpers import sampling_differential as sweep

    target, draft = sweep.models(family)
    failures = []
    for seed in range(seeds):
        case = sweep.random_case(seed, family)
        try:
            sweep.check_case(case, target, draft)
        except AssertionError as error:
            failures.append(f"{case}\n  {error}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu.py runs it there)")
def test_sampling_differential_on_cuda():
    """The same random cases with the models on the GPU: the verification, sampling and lookup kernels (Triton or
    CUDA) under HF's processors and warpers, end to end, against HF's chain enumerated on the CPU."""
    import copy

    from helpers import sampling_differential as sweep

    target, draft = sweep.models("llama")
    on_gpu = copy.deepcopy(target).cuda(), copy.deepcopy(draft).cuda()
    failures = []
    for seed in range(12):
        case = sweep.random_case(seed, "llama")
        try:
            sweep.check_case(case, *on_gpu, reference=target)
        except AssertionError as error:
            failures.append(f"{case}\n  {error}")
    assert not failures, "\n\n".join(failures)


def test_min_new_tokens_masks_an_eos_id_of_zero(pair):
    """eos_token_id=0 (GPT-NeoX/Pythia's <|endoftext|>): masked before min_new_tokens like any EOS id. The models
    are relabelled (ids 0 and t swapped) so that the target emits 0 as its 4th new token."""
    import copy

    target, draft = (copy.deepcopy(m) for m in pair)
    ids = torch.tensor([[84, 39, 64, 30, 63]])
    t = int(hf_generate(target, ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=5)[0, -1])
    with torch.no_grad():
        for m in (target, draft):
            for w in (m.get_input_embeddings().weight, m.get_output_embeddings().weight):
                w[[0, t]] = w[[t, 0]]
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=0, pad_token_id=5, min_new_tokens=6)
    expected = hf_generate(target, ids, **kwargs)
    assert expected.shape[1] > ids.shape[1] + 4  # 0 was masked at the 4th new token
    for extra in (dict(draft_model=draft, num_speculative_tokens=3), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(sk.generate(target, ids, **kwargs, **extra), expected)


def test_min_length_counts_the_prompt(pair):
    """HF: min_length is a total length, prompt included (EOS is masked for min_length - prompt new tokens)."""
    target, draft = pair
    ids = torch.tensor([[84, 39, 64, 30, 63]])
    eos = _eos_after(target, ids, 3)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0, min_length=7)
    expected = hf_generate(target, ids, **kwargs)
    assert expected.shape[1] == ids.shape[1] + 4  # stops at the EOS: min_length (2 new tokens) is below it
    for extra in (dict(draft_model=draft, num_speculative_tokens=3), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(sk.generate(target, ids, **kwargs, **extra), expected)


def test_a_max_length_criterion_one_token_past_max_length_is_refused(pair):
    """MaxLengthCriteria(max_length=8) with max_length=7: HF generates 8 (its criterion replaces HF's own); stopping
    at 7 would be silently one token short."""
    from transformers import StoppingCriteriaList
    from transformers.generation import MaxLengthCriteria

    target, draft = pair
    ids = torch.tensor([[16, 38, 45, 85, 72, 93]])
    kwargs = dict(do_sample=False, max_length=7, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(8)]))
    assert hf_generate(target, ids, **kwargs).shape[1] == 8
    with pytest.raises(ValueError, match=r"stopping_criteria holds a MaxLengthCriteria\(max_length=8\)"):
        sk.generate(target, ids, draft_model=draft, **kwargs)
    same = dict(kwargs, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(7)]))  # no later: exact
    assert torch.equal(sk.generate(target, ids, draft_model=draft, **same), hf_generate(target, ids, **same))


@pytest.mark.parametrize("length", [dict(max_new_tokens=5.5), dict(max_length=10.5)])
def test_forced_eos_with_a_fractional_length_and_a_context_processor(pair, length):
    """With repetition_penalty set, HF's own processor list runs per position, built with a fractional max_length
    too: its ForcedEOS never fires (an integral max_length there forced token 11 last)."""
    target, draft = pair
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    kwargs = dict(do_sample=False, forced_eos_token_id=11, repetition_penalty=1.2, **length)
    expected = hf_generate(target, ids, **kwargs)
    assert expected.shape[1] == 11 and expected[0, -1] != 11
    assert torch.equal(sk.generate(target, ids, draft_model=draft, **kwargs), expected)


@pytest.mark.parametrize("family", ["m2m_100", "t5gemma"])
def test_differential_sweep_new_seq2seq_families(family):
    """The encoder-decoder sweep on two of the newer families (``seq2seq_models.NEW_SEQ2SEQ_FAMILIES``; M2M100's
    pad-skipping positions, T5Gemma's decoder_position_ids and sliding window); 100 seeds of each of them and of
    marian, pegasus, longt5, switch_transformers and umt5 run clean (``python -m helpers.differential --family``)."""
    _sweep_seq2seq(family, seeds=8)


def test_float64_reference_follows_generates_steps_where_a_whole_sequence_forward_differs():
    """``float_error.teacher_forced_logits`` (the harness's float64 reference) is model.generate's steps for FSMT:
    its forward over a whole sequence under use_cache has no causal mask, 2.4 off generate's logits, so every FSMT
    case read 'ill-conditioned'. Here HF's own logits against the float32 reference: within rounding. (UMT5 is
    taken alike, for transformers 5.17's decoder that is not causal without a decoder_attention_mask.)"""
    from helpers.float_error import teacher_forced_logits
    from helpers.seq2seq_models import ALL_SEQ2SEQ_FAMILIES, special_ids, source_batch

    target = ALL_SEQ2SEQ_FAMILIES["fsmt"]()
    ids, mask = source_batch([5, 7], seed=1, pad=special_ids("fsmt")[0])
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, eos_token_id=None,
                          return_dict_in_generate=True, output_logits=True)
    reference = teacher_forced_logits(target, out.sequences, 6, input_ids=ids, attention_mask=mask)
    assert torch.allclose(reference, torch.stack(out.logits, dim=1), atol=1e-4)


def test_sampling_reference_steps_m2m100_pad_tokens_as_generate_does():
    """``hf_chain_probs`` (the sampling differential's reference) gives each continuation the probability of
    model.generate's one-token steps, also where M2M100's pad token is inside it: a forward over the whole decoder
    sequence numbers pads by non-pad rank, another distribution (the sweep then saw 'outcomes of probability 0')."""
    from transformers import GenerationConfig

    from helpers.sampling import NEW, VOCAB, hf_chain_probs
    from helpers.seq2seq_models import bart_like

    target = bart_like("m2m_100", vocab=VOCAB)
    target.generation_config.eos_token_id = target.generation_config.forced_bos_token_id = None
    source, mask = torch.tensor([[3, 4, 5, 3, 4]]), torch.ones(1, 5, dtype=torch.long)
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=NEW, pad_token_id=1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = target.generate(source.expand(64, -1), attention_mask=mask.expand(64, -1), generation_config=config,
                              return_dict_in_generate=True, output_scores=True)
    steps = torch.stack([torch.log_softmax(s.double(), -1) for s in out.scores], 1)  # [64, NEW, VOCAB]
    new = out.sequences[:, 1:]
    assert bool((new[:, :-1] == 1).any())  # the pad token inside some continuations
    expected = steps.gather(2, new.unsqueeze(2)).squeeze(2).sum(1).exp()
    codes = (new * VOCAB ** torch.arange(NEW - 1, -1, -1)).sum(1)
    torch.testing.assert_close(torch.from_numpy(hf_chain_probs(target, source, mask, config))[codes], expected,
                               rtol=1e-4, atol=0)
