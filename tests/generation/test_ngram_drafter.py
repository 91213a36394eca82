"""The n-gram drafter (a distribution q from the context's n-gram counts): its q against a per-row definition,
greedy token-identical to ``model.generate`` (batch 1 and left-padded batches), whole sampled continuations against
the target's distribution (acceptance by sum min(p, q)), a user corpus, one host read per iteration."""

import numpy as np
import pytest
import torch

import speculative_kernels as sk
from helpers.host_reads import step_reading_once
from helpers.models import llama
from helpers.sampling import NEW, VOCAB, continuation_probs, hf_warpers, peaky
from helpers.stats import assert_matches
from speculative_kernels.generation.ngram_drafter import ngram_distribution


def _definition(seq: list[int], order: int, vocab: int) -> list[float]:
    """q of the module docstring for one row, plain Python."""
    q, norm = [0.0] * vocab, 0.0
    for m in range(1, order + 1):
        context = seq[len(seq) - (m - 1):] if m > 1 else []
        following = [seq[s + m - 1] for s in range(len(seq) - (m - 1)) if seq[s : s + m - 1] == context]
        if len(seq) - (m - 1) <= 0 or not following:
            continue
        for token in following:
            q[token] += 4**m / len(following)
        norm += 4**m
    return [x / norm for x in q]


@pytest.mark.parametrize("order", [1, 2, 3])
def test_distribution_matches_the_definition(order):
    g = torch.Generator().manual_seed(order)
    tokens = torch.randint(0, 5, (4, 30), generator=g)
    start = torch.tensor([0, 3, 10, 28])
    end = torch.tensor([30, 25, 30, 30])
    q = ngram_distribution(tokens, start, end, order, 5)
    for b in range(4):
        want = _definition(tokens[b, start[b] : end[b]].tolist(), order, 5)
        assert torch.allclose(q[b], torch.tensor(want), atol=1e-6), b


@pytest.mark.parametrize("order", [1, 2, 3])
def test_greedy_left_padded_batch_matches_hf(order):
    target = llama()
    g = torch.Generator().manual_seed(5)
    phrase = torch.randint(3, 97, (3, 6), generator=g)
    ids = phrase.repeat(1, 3)
    mask = torch.ones_like(ids)
    ids[1, :7], mask[1, :7] = 0, 0  # a left-padded row
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, drafter=sk.NGramDrafter.for_model(target, order=order), num_speculative_tokens=3,
                      speculation_stats=stats, **kwargs)
    assert torch.equal(got, expected)
    assert stats.accepted_tokens > 0 and stats.draft_forwards == 0


@pytest.mark.parametrize("temperature,top_k,top_p,order", [(1.0, 0, 1.0, 2), (0.8, 3, 0.9, 2), (1.0, 0, 1.0, 3)])
def test_whole_continuations_match_target_sampling(temperature, top_k, top_p, order):
    target = peaky(0, 2)
    prompt = torch.tensor([[1, 4, 3, 5, 1, 0, 2, 2, 2, 2, 2, 2]])
    seqs, probs = continuation_probs(target, prompt, hf_warpers(temperature, top_k, top_p))
    torch.manual_seed(2468)
    stats = sk.SpeculationStats()
    rows = 6000
    ids = prompt.expand(rows, -1)  # the mask is given: pad id 0 occurs in the prompt (HF would mask it)
    out = sk.generate(target, ids, attention_mask=torch.ones_like(ids), drafter=sk.NGramDrafter(VOCAB, order=order),
                      num_speculative_tokens=2, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                      max_new_tokens=NEW, pad_token_id=0, speculation_stats=stats)
    assert stats.accepted_tokens > rows // 10
    new = out[:, prompt.shape[1]:].numpy()
    codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


def test_corpus_counts_are_used():
    """A corpus that holds the target's greedy continuation: the drafts get accepted from the first iteration."""
    target = llama()
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(8))
    expected = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    corpus = expected[0].clone()
    for drafter, at_least in ((sk.NGramDrafter.for_model(target, order=3, corpus=corpus), 8),
                              (sk.NGramDrafter.for_model(target, order=3), 0)):
        stats = sk.SpeculationStats()
        got = sk.generate(target, ids, drafter=drafter, num_speculative_tokens=4, max_new_tokens=12,
                          do_sample=False, eos_token_id=None, speculation_stats=stats)
        assert torch.equal(got, expected)
        assert stats.accepted_tokens >= at_least
    assert stats.accepted_tokens < 8  # without the corpus


def test_one_host_read_per_iteration():
    target = llama()
    ids = torch.randint(3, 97, (3, 8), generator=torch.Generator().manual_seed(9)).repeat(1, 2)
    decoder = sk.SpeculativeDecoder(target, drafter=lambda: sk.NGramDrafter.for_model(target), num_speculative_tokens=3)
    for kwargs in (dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_k=10, min_new_tokens=5)):
        session = decoder.start(ids, max_new_tokens=20, pad_token_id=0, **kwargs)
        assert step_reading_once(session) > 1


def test_the_largest_order_gives_a_distribution():
    """Order 63 on a context that recurs (every order's context seen): q was infinite (4^63 times a count overflowed
    float32 before the division by the context's occurrences); 64 and up (4^64 itself infinite: q NaN) are refused."""
    tokens = torch.tensor([[1, 3, 4, 0, 2] * 20])
    q = ngram_distribution(tokens, torch.tensor([0]), torch.tensor([100]), 63, 5)
    assert torch.isfinite(q).all() and torch.allclose(q.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="order must be at most 63"):
        sk.NGramDrafter(10, order=64)


def test_bad_arguments():
    with pytest.raises(ValueError, match="order must be an int >= 1"):
        sk.NGramDrafter(10, order=0)
    with pytest.raises(ValueError, match="corpus must be a 1-D integer tensor"):
        sk.NGramDrafter(10, corpus=torch.zeros(3))
    for corpus in (torch.tensor([1, 2, 500]), torch.tensor([-1, 2])):  # were clamped into the vocabulary silently
        with pytest.raises(ValueError, match=r"corpus holds token ids outside the vocabulary \[0, 10\)"):
            sk.NGramDrafter(10, corpus=corpus)
    with pytest.raises(ValueError, match="corpus must be a 1-D integer tensor"):
        sk.NGramDrafter(10, corpus=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1, got 0"):
        sk.NGramDrafter(0)
    target = llama()
    with pytest.raises(ValueError, match="pass either draft_model"):
        sk.generate(target, torch.tensor([[5, 6]]), draft_model=target, drafter=sk.NGramDrafter(97))


@pytest.mark.parametrize("drafting", ["prompt lookup", "n-gram"])
@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, seed=3)])
def test_one_new_token_without_a_draft_model(drafting, sampling):
    """max_new_tokens=1 runs the target once over the prompt and never starts the drafter (nothing is drafted):
    a drafter without a model is then left alone (it used to be handed the emitted token unstarted)."""
    target = llama()
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    kwargs = (dict(prompt_lookup_num_tokens=3) if drafting == "prompt lookup"
              else dict(drafter=sk.NGramDrafter.for_model(target)))
    out = sk.generate(target, ids, max_new_tokens=1, pad_token_id=0, **kwargs, **sampling)
    assert out.shape == (1, 6)
    if not sampling["do_sample"]:
        assert torch.equal(out, target.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_mask_banning_every_token_seen_leaves_the_unseen_ones(do_sample):
    """BART whose generation_config sets a min_length (as summarisation checkpoints do) and no forced BOS: the
    first draft's context is the decoder start token alone, which is BART's EOS, and min_length bans EOS there, so q
    (the context's counts) had no allowed token and verify raised on its all -inf row. Unseen tokens now get a floor
    far below any count's share: greedy is token-identical to model.generate, sampling keeps the minimum length."""
    from helpers.seq2seq_models import bart

    model = bart()
    model.generation_config.min_length, model.generation_config.forced_bos_token_id = 5, None
    source = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 1, 1]])
    mask = (source != 1).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=8)
    drafter = sk.NGramDrafter.for_model(model)
    if do_sample:
        out = sk.generate(model, source, drafter=drafter, do_sample=True, seed=0, **kwargs)
        eos = (out[:, 1:] == model.config.eos_token_id).int().argmax(dim=1)  # the first EOS after the start token
        assert ((eos == 0) | (eos >= 4)).all()  # never before min_length (5, the start token included)
    else:
        expected = model.generate(source, do_sample=False, **kwargs)
        assert torch.equal(sk.generate(model, source, drafter=drafter, do_sample=False, **kwargs), expected)
