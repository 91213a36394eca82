"""Sampled continuations follow the target's own sampling distribution (HF warpers), for the whole sequence."""

import numpy as np
import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama
from helpers.sampling import NEW, VOCAB, continuation_probs, hf_warpers, peaky
from helpers.stats import assert_matches

ROWS = 6000


@pytest.mark.parametrize(
    "temperature,top_k,top_p,gamma",
    [(1.0, 0, 1.0, 2), (0.8, 0, 1.0, 3), (1.0, 3, 1.0, 2), (1.2, 0, 0.7, 2), (1.0, 4, 0.85, 1)],
)
def test_whole_continuations_match_target_sampling(temperature, top_k, top_p, gamma):
    target, draft = peaky(0, 2), peaky(7, 1)
    prompt = torch.tensor([[1, 4, 3, 5]])
    seqs, probs = continuation_probs(target, prompt, hf_warpers(temperature, top_k, top_p))
    torch.manual_seed(1234)
    out = sk.generate(target, prompt.expand(ROWS, -1), draft_model=draft, num_speculative_tokens=gamma,
                      do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=NEW,
                      pad_token_id=0)
    new = out[:, prompt.shape[1]:].numpy()
    codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


def test_sampling_is_repeatable_with_manual_seed():
    target, draft = peaky(0, 2), peaky(7, 1)
    prompt = torch.tensor([[1, 4, 3, 5]])
    runs = []
    for _ in range(2):
        torch.manual_seed(99)
        runs.append(sk.generate(target, prompt, draft_model=draft, do_sample=True, max_new_tokens=12, top_k=0))
    assert torch.equal(*runs)


def test_random_offsets_are_device_counters_at_fixed_addresses(monkeypatch):
    """Capture-safe randomness: every draft sample and every verification reads its Philox offset from one device
    storage that the loop advances in place (what a captured CUDA graph replays), never from a tensor built from a
    host value per call; per row, the values count the tokens drafted for it and the iterations."""
    from speculative_kernels.generation.request import build_loop
    from speculative_kernels.ops import torch_backend  # what the loop calls on the CPU

    ids = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(3))
    loop = build_loop(llama(), llama(layers=1, seed=3), ids, num_speculative_tokens=3, max_new_tokens=10,
                      do_sample=True, temperature=0.9, pad_token_id=0)
    offsets, values = {"sample": [], "verify": []}, {"sample": [], "verify": []}
    sample, verify = torch_backend.sample, torch_backend.verify

    def record(name, offset):
        offsets[name].append(offset)  # kept alive: a fresh tensor per call would get a new address
        values[name].append(offset.tolist())

    def recording_sample(logits, sampling, randomness):
        record("sample", randomness.offset)
        return sample(logits, sampling, randomness)

    def recording_verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens=None):
        record("verify", randomness.offset)
        return verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens)

    assert loop.impl is torch_backend
    monkeypatch.setattr(torch_backend, "sample", recording_sample)
    monkeypatch.setattr(torch_backend, "verify", recording_verify)
    while loop.step():
        pass
    iterations = len(values["verify"])
    assert iterations > 1
    for name, found in offsets.items():
        assert len({o.untyped_storage().data_ptr() for o in found}) == 1, name
    # Every iteration verifies (a last, target-only one too: ops.verify with no proposal), advancing each row's
    # verify offset by one; each row's draft offset counts the tokens drafted for it: 0, 1, 2, ... within and
    # across iterations, except that a row drafted fewer than gamma tokens near its end gives its fillers'
    # offsets back (its next draw is then at most one past its previous one, never further).
    assert iterations == loop.stats.target_forwards
    assert values["verify"] == [[i, i] for i in range(iterations)]
    assert len(values["sample"]) == loop.stats.draft_forwards > 2 * iterations
    for row in range(2):
        drawn = [v[row] for v in values["sample"]]
        assert drawn[:3] == [0, 1, 2]
        assert all(b <= a + 1 for a, b in zip(drawn, drawn[1:]))


def test_target_only_steps_advance_the_verify_offset(monkeypatch):
    """An iteration with nothing drafted (prompt lookup without a match) draws its token from the target at the next
    verify offset, never at the previous one again (which would reuse the last token's race noise)."""
    from speculative_kernels.generation.request import build_loop
    from speculative_kernels.ops import torch_backend

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])  # no repeated n-gram: the first iterations propose nothing
    loop = build_loop(llama(), None, ids, prompt_lookup_num_tokens=3, max_new_tokens=8, do_sample=True,
                      temperature=1.0, pad_token_id=0, eos_token_id=None, seed=0)
    seen = []
    verify = torch_backend.verify

    def recording_verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens=None):
        seen.append(randomness.offset.tolist())
        return verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens)

    assert loop.impl is torch_backend
    monkeypatch.setattr(torch_backend, "verify", recording_verify)
    while loop.step():
        pass
    assert len(seen) > 2 and seen == [[i] for i in range(len(seen))]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_sampled_scores_are_the_warped_logits_as_hfs(temperature, top_k, top_p):
    """output_scores of a sampled run: the logits after HF's warpers (temperature, top-k, top-p), as
    model.generate(do_sample=True) returns them; output_logits the raw ones."""
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    out = sk.generate(llama(), prompt, draft_model=llama(layers=1, seed=3), max_new_tokens=6, do_sample=True,
                      temperature=temperature, top_k=top_k, top_p=top_p, seed=0, eos_token_id=None,
                      pad_token_id=0, return_dict_in_generate=True, output_scores=True, output_logits=True)
    warpers = hf_warpers(temperature, top_k, top_p)
    for step, (scores, raw) in enumerate(zip(out.scores, out.logits)):
        expected = warpers(out.sequences[:, : prompt.shape[1] + step], raw.clone())
        assert torch.equal(scores, expected), step
        assert int(torch.isfinite(scores).sum()) < raw.shape[-1]  # (the warping cut something)


def test_a_draft_models_invalid_logits_are_named_as_the_draft_models():
    """Sampling reads q: a draft whose logits hold NaN is named as the draft model (it was the op's argument name,
    draft_logits, alone); greedy reads no q and runs, as HF's greedy assisted generation does."""
    from helpers.models import llama

    target, draft = llama(), llama(layers=1, seed=2)
    with torch.no_grad():
        draft.lm_head.weight[5].fill_(float("nan"))
    ids = torch.tensor([[1, 5, 9, 4]])
    with pytest.raises(ValueError, match=r"draft_logits, the draft model's logits \(LlamaForCausalLM\), has NaN"):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=8, do_sample=True, seed=0)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, max_new_tokens=8, do_sample=False),
                       target.generate(ids, max_new_tokens=8, do_sample=False))
