"""Greedy speculative decoding is token-identical to ``model.generate(do_sample=False)``."""

import pytest
import torch

import speculative_kernels as sk
from helpers.float_error import assert_logits_as_accurate_as_hf
from helpers.models import FAMILIES, drafts_for, llama


def _prompt(batch=1, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (batch, length), generator=g)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("draft_kind", ["self", "perturbed", "unrelated"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_matches_hf(family, draft_kind, gamma):
    target = FAMILIES[family]()
    draft = drafts_for(family, target)[draft_kind]
    ids = _prompt()
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=gamma, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, expected)


def test_self_draft_statistics_are_exact():
    target = llama()
    stats = sk.SpeculationStats()
    gamma = 4
    out = sk.generate(target, _prompt(), draft_model=target, num_speculative_tokens=gamma, max_new_tokens=20,
                      do_sample=False, speculation_stats=stats)
    assert out.shape[1] == 7 + 20
    assert stats.acceptance_rate == 1.0
    assert stats.mean_tokens_per_target_forward == gamma + 1
    assert stats.target_forwards == 20 // (gamma + 1)
    assert stats.draft_forwards == gamma * stats.target_forwards
    assert stats.accepted_histogram == [0, 0, 0, 0, stats.target_forwards]
    assert stats.new_tokens == 20


def _eos_at(target, ids, position):
    """A token id the target greedily emits at ``position`` (and not before), to use as EOS."""
    free = target.generate(ids, max_new_tokens=position + 1, do_sample=False, eos_token_id=None)
    new = free[0, ids.shape[1]:].tolist()
    for pos in range(position, len(new)):
        if new[pos] not in new[:pos]:
            return new[pos], pos
    pytest.skip("no fresh token to use as EOS")


@pytest.mark.parametrize("draft_kind", ["self", "perturbed"])
def test_eos_inside_accepted_block(draft_kind):
    target = llama()
    draft = drafts_for("llama", target)[draft_kind]
    ids = _prompt(seed=3)
    eos, pos = _eos_at(target, ids, 6)
    expected = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, max_new_tokens=30, do_sample=False,
                      eos_token_id=eos, pad_token_id=0)
    assert expected.shape[1] == ids.shape[1] + pos + 1
    assert torch.equal(got, expected)


@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 11])
def test_max_new_tokens_cuts_a_block(max_new_tokens):
    target = llama()
    ids = _prompt(seed=4)
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=4, max_new_tokens=max_new_tokens,
                      do_sample=False, speculation_stats=stats)
    assert torch.equal(got, expected)
    assert stats.new_tokens == max_new_tokens


def test_max_new_tokens_zero_returns_prompt():
    target = llama()
    ids = _prompt()
    assert torch.equal(sk.generate(target, ids, draft_model=target, max_new_tokens=0), ids)


def test_max_length_and_generation_config_defaults():
    target = llama()
    ids = _prompt()
    target.generation_config.max_length = 15  # the model's own default applies, as in HF
    expected = target.generate(ids, do_sample=False)
    got = sk.generate(target, ids, draft_model=llama(layers=1, seed=5), do_sample=False)
    assert got.shape[1] == 15 and torch.equal(got, expected)
    got = sk.generate(target, ids, draft_model=target, max_length=12)
    assert torch.equal(got, target.generate(ids, max_length=12))


def test_min_new_tokens_suppresses_eos():
    target = llama()
    ids = _prompt(seed=3)
    eos, pos = _eos_at(target, ids, 2)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0, min_new_tokens=pos + 4)
    expected = target.generate(ids, **kwargs)
    got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=3, **kwargs)
    assert torch.equal(got, expected)


def test_return_dict_scores_and_logits_match_hf():
    target = llama()
    draft = llama(layers=1, seed=9)
    ids = _prompt()
    kwargs = dict(max_new_tokens=9, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True)
    expected = target.generate(ids, **kwargs)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs)
    assert isinstance(got, type(expected)) or isinstance(got, sk.SpeculativeDecoderOnlyOutput)
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    assert isinstance(got, GenerateDecoderOnlyOutput)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) == 9
    assert_logits_as_accurate_as_hf(target, got, expected)
    assert got.speculation_stats.new_tokens == 9


def test_each_steps_scores_are_a_tensor_of_their_own_as_hfs():
    """HF returns a contiguous [B, V] tensor per step: ``view(-1)`` works, and keeping one step keeps [B, V] alive.
    Ours were views of one [B, steps, V] copy (found at V = 262144: one kept step held all 512 steps, 4.3 GB)."""
    target = llama()
    ids = _prompt(batch=2)
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, pad_token_id=0)
    got = sk.generate(target, ids, draft_model=llama(layers=1, seed=9), num_speculative_tokens=3, **kwargs)
    for steps in (got.scores, got.logits):
        for step in steps:
            assert step.is_contiguous() and step.view(-1).numel() == step.numel()
            assert step.untyped_storage().nbytes() == step.numel() * step.element_size()


def test_scores_and_logits_of_a_finished_row_are_zeros_after_its_eos():
    """Documented difference (README): after a row of a batch has finished, model.generate keeps feeding it the pad
    id and returns the model's logits (and scores) on it; a finished row leaves our batch and its entries are zeros.
    Up to and including its EOS step they are HF's."""
    target, draft = llama(), llama(layers=1, seed=9)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    kwargs = dict(attention_mask=(ids != 0).long(), max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    eos = int(target.generate(ids, **kwargs).sequences[0, 7])  # row 0's second new token
    expected = target.generate(ids, **kwargs, eos_token_id=eos)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs, eos_token_id=eos)
    assert torch.equal(got.sequences, expected.sequences) and expected.sequences[1, 6:].ne(eos).all()
    for name in ("scores", "logits"):
        ours, theirs = torch.stack(getattr(got, name), 1), torch.stack(getattr(expected, name), 1)
        torch.testing.assert_close(ours[0, :2], theirs[0, :2])  # up to row 0's EOS
        torch.testing.assert_close(ours[1], theirs[1])  # the unfinished row throughout
        assert ours[0, 2:].eq(0).all() and theirs[0, 2:].ne(0).any()


def _usable_outside_no_grad(tensor):
    """What a user does with model.generate's output (an RL rollout trained on, an edit in place): an inference
    tensor (made under torch.inference_mode) raises on both."""
    assert not tensor.is_inference()
    tensor.clone().float().requires_grad_().sum().backward()
    tensor[..., -1:] = tensor[..., -1:]


def test_outputs_are_ordinary_tensors_as_in_hf():
    target, draft = llama(), llama(layers=1, seed=9)
    ids = _prompt()
    got = sk.generate(target, ids, draft_model=draft, max_new_tokens=6)
    _usable_outside_no_grad(got)
    target(got, labels=got).loss.backward()  # training on the generated sequence, as after model.generate
    out = sk.generate(target, ids, prompt_lookup_num_tokens=3, max_new_tokens=6, return_dict_in_generate=True,
                      output_scores=True, output_logits=True)
    for tensor in (out.sequences, *out.scores, *out.logits):
        _usable_outside_no_grad(tensor)


def test_streamer_receives_prompt_then_every_token():
    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    target = llama()
    ids = _prompt()
    streamer = Collect()
    out = sk.generate(target, ids, draft_model=target, max_new_tokens=10, do_sample=False, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, ids.shape[1]:].tolist()


def test_stopping_criteria_checked_after_every_token():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAtLength(StoppingCriteria):
        def __init__(self, length):
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

    target = llama()
    ids = _prompt()
    criteria = StoppingCriteriaList([StopAtLength(ids.shape[1] + 6)])
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=criteria)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=4, max_new_tokens=20,
                      do_sample=False, stopping_criteria=criteria, speculation_stats=stats)
    assert torch.equal(got, expected)
    assert stats.new_tokens == 6  # (counted the cut tokens of the stopping iteration too: 10)


def test_stopping_criteria_receive_hf_scores():
    """A criterion gets what HF's gives it: scores=None, or with return_dict_in_generate and output_scores the
    tuple of every step's scores so far (a criterion reading them, e.g. stopping on a low top probability, got None
    here always)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Record(StoppingCriteria):
        def __init__(self):
            self.calls = []

        def __call__(self, input_ids, scores, **kwargs):
            if scores is None:
                self.calls.append((input_ids.shape[1], None))
            else:
                assert int(scores[-1].argmax(-1)) == int(input_ids[0, -1])  # greedy: the token scored highest
                self.calls.append((input_ids.shape[1], len(scores), input_ids[0, -1].item()))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    target, draft = llama(), llama(layers=1, seed=9)
    ids = _prompt()
    for kwargs in ({}, dict(return_dict_in_generate=True, output_scores=True),
                   dict(return_dict_in_generate=True, output_scores=True, repetition_penalty=1.3)):
        theirs, ours = Record(), Record()
        target.generate(ids, max_new_tokens=9, do_sample=False, stopping_criteria=StoppingCriteriaList([theirs]),
                        **kwargs)
        sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=9, do_sample=False,
                    stopping_criteria=StoppingCriteriaList([ours]), **kwargs)
        assert ours.calls == theirs.calls and len(ours.calls) == 9, kwargs


def test_no_iteration_after_a_stopping_criterion_fires():
    """Once a criterion fires, the loop stops: no further draft + verify iteration (counted at the target)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    target = llama()
    forwards = []
    target.register_forward_pre_hook(sk.per_token_hook(lambda module, args: forwards.append(1)))
    fired_at = []

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stop = input_ids.shape[1] >= ids.shape[1] + 6
            if stop and not fired_at:
                fired_at.append(len(forwards))
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool)

    ids = _prompt()
    stats = sk.SpeculationStats()
    out = sk.generate(target, ids, draft_model=llama(layers=1, seed=3), num_speculative_tokens=4,
                      max_new_tokens=20, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAtLength()]),
                      speculation_stats=stats)
    assert out.shape[1] == ids.shape[1] + 6
    assert fired_at and len(forwards) == fired_at[0], (fired_at, len(forwards))
    assert stats.target_forwards == len(forwards) - stats.prefill_forwards


def test_a_stopping_criterion_answering_other_than_one_value_is_named():
    """A criterion returns one value for the one row (a bool, a bool tensor [1]). None (a criterion without a return)
    failed inside torch, and two values were read as 'any of them' and stopped the call; model.generate fails on
    both inside torch. Each is named here."""
    target, draft = llama(), llama(layers=1, seed=3)
    ids = _prompt()

    def returns_nothing(input_ids, scores):
        pass

    def answers_for_two_rows(input_ids, scores):
        return torch.tensor([False, input_ids.shape[1] > ids.shape[1] + 2])

    def plain_bool(input_ids, scores):
        return input_ids.shape[1] >= ids.shape[1] + 4

    def answers_for_no_row(input_ids, scores):
        return torch.zeros(0, dtype=torch.bool)

    with pytest.raises(TypeError, match="stopping criterion returns_nothing returned NoneType"):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=8, stopping_criteria=[returns_nothing])
    with pytest.raises(ValueError, match="stopping criterion answers_for_two_rows returned 2 values"):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=8, stopping_criteria=[answers_for_two_rows])
    with pytest.raises(ValueError, match=r"stopping criterion answers_for_no_row returned 0 values .*shape \(0,\)"):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=8, stopping_criteria=[answers_for_no_row])
    expected = target.generate(ids, max_new_tokens=8, do_sample=False, stopping_criteria=[plain_bool])
    assert expected.shape[1] == ids.shape[1] + 4
    assert torch.equal(sk.generate(target, ids, draft_model=draft, max_new_tokens=8, stopping_criteria=[plain_bool]),
                       expected)


def test_assistant_model_alias_and_padded_prompt():
    target = llama()
    ids = _prompt()
    mask = torch.ones_like(ids)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    got = sk.generate(target, ids, attention_mask=mask, assistant_model=target, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


def test_bos_only_when_no_prompt():
    target = llama()
    expected = target.generate(max_new_tokens=6, do_sample=False)
    got = sk.generate(target, draft_model=target, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)


def test_max_time_stops_every_row_after_the_iteration_it_passes_in():
    """max_time (HF's MaxTimeCriteria: every row stops after the step in which the time passed): the output is a
    prefix of the unbounded one, cut after the first iteration when the time is already up; a generous bound changes
    nothing. Not a timing assertion: 1e-9 s has passed by the end of any iteration."""
    target, draft = llama(), llama(layers=1, seed=3)
    ids = torch.tensor([[0, 0, 84, 39, 64], [5, 6, 7, 8, 9]])
    mask = (ids != 0).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    full = target.generate(ids, **kwargs)
    cut = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_time=1e-9, **kwargs)
    assert ids.shape[1] < cut.shape[1] <= ids.shape[1] + 4  # one iteration: at most gamma + 1 tokens
    assert torch.equal(cut, full[:, : cut.shape[1]])
    assert torch.equal(sk.generate(target, ids, draft_model=draft, max_time=3600.0, **kwargs), full)
    # 0, which model.generate takes (one step), was refused
    zero = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_time=0, **kwargs)
    assert ids.shape[1] < zero.shape[1] <= ids.shape[1] + 4 and torch.equal(zero, full[:, : zero.shape[1]])
    with pytest.raises(ValueError, match="max_time"):
        sk.generate(target, ids, draft_model=draft, max_time=-1.0, **kwargs)


def _assert_counts_what_was_emitted(stats):
    """Each row-step (a row in one target forward) is in the histogram by the tokens it emitted less one, so the
    mean is the new tokens per row-step and the kept drafts are the new tokens less one per row-step."""
    assert stats.verify_steps and stats.mean_tokens_per_target_forward == stats.new_tokens / stats.verify_steps
    assert stats.accepted_tokens == sum(n * k for n, k in enumerate(stats.accepted_histogram))
    assert stats.accepted_tokens == stats.new_tokens - stats.verify_steps
    assert stats.accepted_tokens <= stats.drafted_tokens and stats.accept_tests_passed <= stats.accept_tests


@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 11, 22])
def test_statistics_count_every_target_forward(max_new_tokens):
    """Shortened iterations (the last tokens: gamma capped at the tokens left less one, or none) count: the mean is
    new_tokens / target_forwards at batch 1 (they were left out of the histogram: 3 tokens reported as
    "n/a", 22 as 5.0 per forward though the fifth forward gave 2)."""
    target = llama()
    stats = sk.SpeculationStats()
    sk.generate(target, _prompt(seed=4), draft_model=target, num_speculative_tokens=4,
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, speculation_stats=stats)
    assert stats.new_tokens == max_new_tokens and stats.verify_steps == stats.target_forwards
    _assert_counts_what_was_emitted(stats)
    # the draft is the target: every draft it could use was accepted
    assert stats.acceptance_rate == (1.0 if max_new_tokens > 1 else 0.0) and stats.alpha == stats.acceptance_rate


@pytest.mark.parametrize("do_sample", [False, True])
def test_statistics_count_no_draft_past_an_eos(do_sample):
    """An EOS inside the accepted drafts: the drafts after it were verified, never emitted. They are not kept
    drafts (the self-draft's 7 tokens from 2 forwards were reported as 8 accepted drafts and 5.0 tokens per
    forward); alpha keeps their tests, which were made."""
    target = llama()
    ids = _prompt(seed=3)
    eos, pos = _eos_at(target, ids, 6)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=4, max_new_tokens=30,
                      do_sample=do_sample, temperature=1e-6 if do_sample else None, eos_token_id=eos,
                      pad_token_id=0, speculation_stats=stats, seed=0)
    assert got.shape[1] == ids.shape[1] + pos + 1 and stats.new_tokens == pos + 1 == 7
    assert stats.target_forwards == 2 and stats.accepted_histogram == [0, 1, 0, 0, 1]
    assert stats.accepted_tokens == 5 and stats.mean_tokens_per_target_forward == 3.5
    assert stats.drafted_tokens == 8 and stats.accept_tests == stats.accept_tests_passed == 8
    _assert_counts_what_was_emitted(stats)


def test_greedy_batch_statistics_are_the_rows_alone():
    """A greedy row is drafted what it is drafted alone: the batch's gamma, but never past its own tokens left less
    one (as a sampled row's limit): the batch's counts are the sums of its rows' counts alone (the drafts past a
    row's end, which the greedy batch verifies, were counted as drafted and accepted)."""
    target = llama()
    draft = drafts_for("llama", target)["perturbed"]
    ids = _prompt(batch=3, seed=11)
    kwargs = dict(draft_model=draft, num_speculative_tokens=4, max_new_tokens=17, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
    stats = sk.SpeculationStats()
    sk.generate(target, ids, speculation_stats=stats, **kwargs)
    alone = []
    for row in ids:
        alone.append(sk.SpeculationStats())
        sk.generate(target, row[None], speculation_stats=alone[-1], **kwargs)
    for name in ("new_tokens", "drafted_tokens", "accepted_tokens", "accept_tests", "accept_tests_passed"):
        assert getattr(stats, name) == sum(getattr(s, name) for s in alone), name
    width = len(stats.accepted_histogram)
    assert stats.accepted_histogram == [sum(s.accepted_histogram[n] for s in alone if n < len(s.accepted_histogram))
                                        for n in range(width)]
    _assert_counts_what_was_emitted(stats)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (ids and model on different devices)")
@pytest.mark.parametrize("model_on, ids_on", [("cuda", "cpu"), ("cpu", "cuda")])
def test_result_is_on_the_device_of_the_callers_ids(model_on, ids_on):
    """model.generate keeps the ids where the caller put them (moving only each forward's inputs to the model) and
    returns its sequences there; ours returned them on the model's device (found by the first GPU run of
    test_compile's checkpoint-settings test, whose prompt was on CUDA and model on the CPU)."""
    target = llama().to(model_on)
    ids = _prompt().to(ids_on)
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=2, max_new_tokens=8, do_sample=False)
    assert expected.device == got.device == ids.device
    assert torch.equal(got, expected)
    outputs = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, max_new_tokens=8,
                   do_sample=False)
    out = sk.generate(target, ids, draft_model=target, num_speculative_tokens=2, **outputs)
    reference = target.generate(ids, **outputs)
    for ours, theirs in ((out.scores, reference.scores), (out.logits, reference.logits)):
        assert {s.device for s in ours} == {s.device for s in theirs} == {ids.device}
    target.compute_transition_scores(out.sequences, out.scores)  # (mixing devices failed in it)


@pytest.mark.parametrize("embedding, rest", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32)])
def test_an_input_embedding_in_another_dtype_than_the_layers(embedding, rest):
    """The runners built their additive masks in the first parameter's dtype, the input embedding's: a bfloat16
    embedding beside float32 layers (to save memory) failed inside SDPA, and a float32 one beside float64 layers
    gave other tokens (torch's CPU SDPA mishandles a float32 mask on float64 queries), where model.generate runs
    both. The mask now takes the layers' dtype."""
    target = llama().to(rest)
    target.model.embed_tokens.to(embedding)
    draft = llama(seed=1)
    ids = _prompt()
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    for cache in ({}, {"cache_implementation": "static"}):  # (the static cache's K/V buffers: the layers' dtype)
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, max_new_tokens=24,
                          do_sample=False, **cache)
        assert torch.equal(got, expected), cache


def test_a_vision_language_model_with_a_tower_in_another_dtype():
    """The mask dtype came from the first floating parameter outside the input embedding: in a vision-language model
    that is the vision tower's (float32 beside a bfloat16 language model: transformers 5 loads per-part dtypes), so
    bfloat16 queries got a float32 mask. It now comes from the text decoder (get_decoder)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=110))
    model.eval().to(torch.bfloat16)
    model.model.vision_tower.float()
    from speculative_kernels.generation.runners.masks import attention_dtype

    assert attention_dtype(model) == torch.bfloat16
    ids = torch.tensor([[5, 17, 33, 8, 61, 9]])
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = model.generate(ids, **settings)
    for cache in ({}, {"cache_implementation": "static"}):
        got = sk.generate(model, ids, draft_model=model, num_speculative_tokens=3, **settings, **cache)
        assert torch.equal(got, expected), cache


@pytest.mark.parametrize("drafting", ["model", "lookup"])
def test_a_gamma_far_above_what_is_left_costs_nothing(drafting):
    """HF caps each iteration's drafts at what is left; nothing here is sized for more (10**10 slots could not be
    allocated: the runners' slot masks, prompt lookup's context and proposal were sized by the requested gamma)."""
    target = llama(seed=0)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    huge = 10**10
    draft = llama(layers=1, seed=1) if drafting == "model" else None
    kwargs = {"num_speculative_tokens": huge} if drafting == "model" else {"prompt_lookup_num_tokens": huge}
    out = sk.generate(target, ids, draft_model=draft, max_new_tokens=8, do_sample=False, **kwargs)
    assert torch.equal(out, target.generate(ids, max_new_tokens=8, do_sample=False))
    session = sk.SpeculativeDecoder(target, draft, **kwargs).start(ids, max_new_tokens=8, do_sample=False)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), out)
