"""HF's block-processable logits processors on the draft's logits too (``generation/draft_processors.py``): the draft
proposes what the processed target would. With the target as its own draft every proposal is then accepted (the
processed draft is the processed target), where an unprocessed draft proposes the tokens the bans turn the target
away from; output stays ``model.generate``'s."""

import pytest
import torch

import speculative_kernels as sk
from helpers.models import hf_generate, llama

BATCH = torch.tensor([[0, 0, 84, 39, 64, 30, 63], [5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 3, 4, 5]])
MASK = (BATCH != 0).long()
# (the bans the draft runs: ``DRAFT_BANS``)
SETTINGS = dict(no_repeat_ngram_size=2, suppress_tokens=[13, 40], bad_words_ids=[[24]], min_new_tokens=4,
                eos_token_id=2)


@pytest.fixture(scope="module")
def target():
    return llama()


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_a_self_draft_with_processors_has_every_draft_accepted_greedy(target, cache):
    """Greedy, batch 3 left-padded: tokens identical to model.generate, and every draft accepted (before: 44 of 72
    accepted, the draft proposing the banned repeats)."""
    expected = hf_generate(target, BATCH, attention_mask=MASK, max_new_tokens=24, do_sample=False, pad_token_id=0,
                           **SETTINGS)
    stats = sk.SpeculationStats()
    got = sk.generate(target, BATCH, attention_mask=MASK, draft_model=target, num_speculative_tokens=3,
                      max_new_tokens=24, do_sample=False, pad_token_id=0, cache_implementation=cache,
                      speculation_stats=stats, **SETTINGS)
    assert torch.equal(got, expected)
    assert stats.drafted_tokens > 20 and stats.accepted_tokens == stats.drafted_tokens, stats


def test_a_self_draft_with_processors_has_every_draft_accepted_sampled(target):
    """Sampled: q is the processed distribution the draft token was drawn from, which is p here, so every accept
    test passes (before: 52 of 55: drafts of banned tokens, p = 0, always rejected)."""
    stats = sk.SpeculationStats()
    torch.manual_seed(0)
    # (EOS suppressed: a drafted EOS ends its row, and the drafts after it count as not accepted)
    sk.generate(target, BATCH, attention_mask=MASK, draft_model=target, num_speculative_tokens=3, max_new_tokens=24,
                do_sample=True, temperature=0.7, pad_token_id=0, speculation_stats=stats,
                **dict(SETTINGS, suppress_tokens=[2, 13, 40]))
    assert stats.drafted_tokens > 20 and stats.accepted_tokens == stats.drafted_tokens, stats


def test_a_draft_steps_ops_do_not_grow_with_the_batch(target):
    """What the draft's bans read of each row's processors (EOS ids, suppressed ids, lengths, biases: small tensors
    per row) is built once per iteration, not at every draft step: a draft step dispatches as many ops for 8 rows
    as for 1 (before: 108.5 ops per step at batch 1, 164.75 at batch 8, a reshape and a device move per row and
    ban at every step). Deterministic op counts (a dispatch mode), no timing."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from speculative_kernels.generation.draft_processors import DraftProcessors
    from speculative_kernels.generation.request import build_loop

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    gamma, per_step = 4, {}
    for batch in (1, 8):
        ids = torch.randint(3, 97, (batch, 7), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            loop = build_loop(target, target, ids, num_speculative_tokens=gamma, max_new_tokens=8, do_sample=False,
                              pad_token_id=0, attention_mask=torch.ones_like(ids), begin_suppress_tokens=[5],
                              **SETTINGS)
            rows = list(range(batch))
            bans = DraftProcessors.start(loop.processors.stages, loop._contexts(rows), rows, gamma, ids.device)
            logits, count = torch.randn(batch, 97), Count()
            with count:
                for i in range(gamma):
                    bans.process(logits, i)
                    bans.drafted(logits.argmax(dim=-1), i)
        per_step[batch] = sum(count.ops.values()) / gamma
    assert per_step[8] <= per_step[1], per_step


def test_each_rows_draft_runs_its_own_processors(target):
    """Two requests of one batch (a SpeculativeDecoder) with processors of the same class and other settings: each
    row's draft bans what its own processors ban, so every draft is accepted in both rows. Mutation hunt: every row
    given the first row's processors (``_Group``'s chains) passed the rest: the second row drafted the ids its own
    target never emits and lost 6 of 9 drafts."""
    prompts = [5, 6, 7, 8], [9, 10, 11]
    alone = [target.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
             for p in prompts]
    decoder = sk.SpeculativeDecoder(target, target, num_speculative_tokens=3)
    ids = [decoder.add_request(prompt, max_new_tokens=8, do_sample=False,
                               suppress_tokens=sorted(set(alone[1 - row]) - set(alone[row])))
           for row, prompt in enumerate(prompts)]
    while decoder.has_work():
        decoder.step()
    for request_id, expected in zip(ids, alone):
        result = decoder.result(request_id)
        assert result.token_ids == expected
        assert result.drafted_tokens > 0 and result.accepted_tokens == result.drafted_tokens, result
