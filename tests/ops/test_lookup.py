"""``ops.prompt_lookup``: the reference against a per-row definition and HF's ``PromptLookupCandidateGenerator``,
and the Triton kernel (interpreter on CPU) identical to the reference."""

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from speculative_kernels.ops.lookup import prompt_lookup, prompt_lookup_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _definition(row: list[int], start: int, end: int, k: int, max_ngram: int, latest: bool, periodic=False):
    """Written out from the docstring, one row, plain Python."""
    seq = row[start:end]
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        starts = [j for j in range(len(seq) - n) if seq[j : j + n] == suffix]
        if starts:
            s = (starts[-1] if latest else starts[0]) + n
            copied = seq[s : s + k]
            while periodic and len(copied) < k:  # the text repeats with period len(seq) - s
                copied.append(copied[len(copied) - (len(seq) - s)])
            return copied + [seq[-1]] * (k - len(copied)), len(copied)
    return [seq[-1]] * k, 0


def _case(batch, width, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, width), generator=g)
    end = torch.randint(1, width + 1, (batch,), generator=g)
    start = (torch.rand(batch, generator=g) * end).long().clamp(max=end - 1)
    end[0], start[0] = width, 0  # a full row
    return tokens, start, end


CASES = [(1, 1, 5, 0), (3, 7, 3, 1), (4, 40, 6, 2), (5, 111, 20, 3), (2, 600, 9, 4), (6, 64, 2, 5)]


@pytest.mark.parametrize("batch,width,vocab,seed", CASES)
@pytest.mark.parametrize("k,max_ngram", [(1, 1), (4, 2), (10, 3)])
@pytest.mark.parametrize("latest,periodic", [(False, False), (True, False), (True, True), (False, True)])
def test_reference_matches_the_definition(batch, width, vocab, seed, k, max_ngram, latest, periodic):
    tokens, start, end = _case(batch, width, vocab, seed)
    proposal, count = prompt_lookup_reference(tokens, start, end, k, max_ngram, latest, periodic)
    for b in range(batch):
        want, n = _definition(tokens[b].tolist(), int(start[b]), int(end[b]), k, max_ngram, latest, periodic)
        assert proposal[b].tolist() == want and int(count[b]) == n, b


@pytest.mark.parametrize("k,max_ngram", [(10, 2), (3, 1), (5, 4)])
def test_reference_is_hf_candidate_rule(k, max_ngram):
    """Batch-1 rows without padding: the same tokens as HF's prompt-lookup candidates."""
    g = torch.Generator().manual_seed(k * 10 + max_ngram)
    for trial in range(30):
        length = int(torch.randint(2, 60, (1,), generator=g))
        ids = torch.randint(0, 4 + trial % 5, (1, length), generator=g)
        hf = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=max_ngram,
                                            max_length=10_000)
        candidates, _ = hf.get_candidates(ids)
        want = candidates[0, length:].tolist()
        proposal, count = prompt_lookup_reference(ids, torch.tensor([0]), torch.tensor([length]), k, max_ngram)
        assert proposal[0, : int(count)].tolist() == want, (ids.tolist(), want)


@pytest.mark.parametrize("batch,width,vocab,seed", CASES)
@pytest.mark.parametrize("latest,periodic", [(False, False), (True, False), (True, True)])
def test_triton_identical_to_reference(batch, width, vocab, seed, latest, periodic):
    tokens, start, end = (x.to(DEVICE) for x in _case(batch, width, vocab, seed))
    for k, max_ngram in [(4, 2), (10, 3)]:
        rule = dict(num_tokens=k, max_ngram=max_ngram, prefer_latest=latest, periodic=periodic)
        want = prompt_lookup(tokens, start, end, **rule, backend="torch")
        got = prompt_lookup(tokens, start, end, **rule, backend="triton")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_strided_view_of_a_longer_buffer():
    tokens, start, end = (t.to(DEVICE) for t in _case(3, 50, 4, 7))
    buffer = torch.cat([tokens, tokens], dim=1)[:, :50]
    want = prompt_lookup(tokens, start, end, num_tokens=5, backend="torch")
    got = prompt_lookup(buffer, start, end, num_tokens=5, backend="triton")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_compiles_fullgraph():
    tokens, start, end = _case(2, 30, 3, 8)
    compiled = torch.compile(lambda t, s, e: prompt_lookup(t, s, e, num_tokens=4, backend="torch"),
                             fullgraph=True, backend="aot_eager")
    want = prompt_lookup(tokens, start, end, num_tokens=4, backend="torch")
    got = compiled(tokens, start, end)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("bad", [dict(num_tokens=0), dict(max_ngram=0), dict(num_tokens=True)])
def test_bad_arguments(bad):
    tokens = torch.zeros(1, 4, dtype=torch.int64)
    kwargs = dict(num_tokens=2, max_ngram=2) | bad
    with pytest.raises(ValueError):
        prompt_lookup(tokens, torch.tensor([0]), torch.tensor([4]), **kwargs)
    with pytest.raises(ValueError):
        prompt_lookup(tokens.int(), torch.tensor([0]), torch.tensor([4]), num_tokens=2)


def test_public_name():
    from speculative_kernels import ops

    assert ops.prompt_lookup is prompt_lookup  # the name the docs use
