"""HF's common logits processors over a whole block at once (``generation/block_processors.py``): the scores are
bit-identical to calling HF's processors per row and position, over ragged contexts (left pads, drafts repeating the
context, n-grams across the context/block boundary), with per-row settings and a per-row processor between fast
ones; greedy output token-identical to ``model.generate`` at batch 3."""

import warnings

import pytest
import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

import speculative_kernels as sk
from speculative_kernels.generation import context_processors
from speculative_kernels.generation.context_processors import RowProcessors
from helpers.models import hf_generate, llama

V, T = 40, 5
EOS = torch.tensor([2, 7])
# Ragged rows, ids from a small range so that tokens and n-grams repeat: row 0 left-padded (pad 0, as a batch's
# rows are), row 1 repeats "4 5" across the end of its context into its drafts, row 3 is shorter than an n-gram
CONTEXTS = [[0, 0, 0, 4, 9, 4, 5, 6], [3, 4, 5, 8, 4, 5], [5, 6, 5, 6, 5, 6, 5, 9, 9, 1, 3], [6]]
DRAFTS = torch.tensor([[4, 5, 4, 5], [8, 4, 5, 8], [5, 6, 5, 11], [6, 6, 3, 6]])


class _AddLength(LogitsProcessor):
    """A processor of the caller's own (called per row): adds 0.125 * len(input_ids) everywhere."""

    def __call__(self, input_ids, scores):
        return scores + 0.125 * input_ids.shape[-1]


def _prepared(processor, device="cpu"):
    """A bias processor after its first call (which checks its ids and builds its bias, in HF's own code)."""
    processor(torch.tensor([[1]], device=device), torch.zeros(1, V, device=device))
    return processor


def _lists(same_settings: bool, device="cpu") -> list:
    """Per row, HF's processors in one order (the caller's own between them): the same settings for every row, or
    settings differing by row (a batch of requests; row 3's sequence bias has a two-token sequence, which is called
    per row: its stages differ from the other rows')."""
    eos = EOS.to(device)
    bad_words = _prepared(NoBadWordsLogitsProcessor([[11], [13]], EOS), device)  # (one for the batch, as HF's)
    bias = _prepared(SequenceBiasLogitsProcessor({(5,): -3.0, (9,): 2.5, (20,): -0.0}), device)
    other = _prepared(SequenceBiasLogitsProcessor({(9,): -1.5, (6,): 4.0}), device)  # (a request's own: row 1)
    longer = _prepared(SequenceBiasLogitsProcessor({(5,): -3.0, (4, 5): 1.5}), device)
    lists = []
    for b, context in enumerate(CONTEXTS):
        vary = 0 if same_settings else b
        ignore = [None, 3, torch.tensor([2], dtype=torch.int32, device=device), 0][vary]  # (5.24 builds a [1] tensor per row)
        lists.append([
            RepetitionPenaltyLogitsProcessor([1.3, 0.7, 1.3, 2.0][vary], prompt_ignore_length=ignore)
            if isinstance(ignore, (int, type(None))) else _penalty_with_tensor(1.3, ignore),
            NoRepeatNGramLogitsProcessor([2, 3, 2, 1][vary]),
            bad_words,
            bias if same_settings or b in (0, 2) else other if b == 1 else longer,
            _AddLength(),
            MinLengthLogitsProcessor([len(context) + 2, 9, 14, 3][vary], eos),
            MinNewTokensLengthLogitsProcessor(len(context), [3, 1, 2, 4][vary], eos),
            SuppressTokensLogitsProcessor([11, 12, V + 5], device=device),  # (an id past V: matches nothing, as HF)
            SuppressTokensAtBeginLogitsProcessor([4, 13], len(context) + [1, 0, 2, 3][vary], device=device),
        ])
    return lists


def _penalty_with_tensor(penalty: float, ignore: torch.Tensor):
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    processor.prompt_ignore_length = ignore  # (5.17's __init__ takes an int only; its __call__ takes a [1] tensor)
    return processor


def _scores(seed: int = 0) -> torch.Tensor:
    """[B, T, V] float32 of both signs, with exact zeros of both signs (HF's bias adds +0.0: -0.0 becomes +0.0)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(CONTEXTS), T, V, generator=g) * 3
    draw = torch.rand(scores.shape, generator=g)
    return scores.masked_fill(draw < 0.05, 0.0).masked_fill(draw < 0.025, -0.0)


def _per_row_reference(lists: list, scores: torch.Tensor) -> torch.Tensor:
    """HF's processors called at each row and position with that position's input_ids [1, L_b + j]."""
    out = scores.clone()
    for b, processors in enumerate(lists):
        for j in range(T):
            ids = torch.tensor([CONTEXTS[b] + DRAFTS[b, :j].tolist()], device=scores.device)
            row = scores[b : b + 1, j].clone()
            for processor in processors:
                row = processor(ids, row)
            out[b, j] = row[0]
    return out


def _processed(lists: list, scores: torch.Tensor) -> torch.Tensor:
    logits, device = scores.clone(), scores.device
    contexts = [torch.tensor([c], device=device) for c in CONTEXTS]
    assert RowProcessors(lists).process(logits, contexts, DRAFTS.to(device), list(range(len(CONTEXTS)))) == {}
    return logits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("same_settings", [True, False])
def test_block_processing_is_bit_identical_to_per_row_calls(same_settings, device, monkeypatch):
    """(On CUDA too: ``x / penalty`` with a Python float is a reciprocal multiply there, in HF's calls as here.)"""
    scores, lists = _scores().to(device), _lists(same_settings, device)
    expected = _per_row_reference(_lists(same_settings, device), scores)
    assert (expected == float("-inf")).sum() > 20 and not torch.equal(expected, scores)
    handled = (RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, MinLengthLogitsProcessor,
               MinNewTokensLengthLogitsProcessor, SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
               NoBadWordsLogitsProcessor)
    for cls in handled:  # (the block path runs: HF's own __call__ is never reached)
        monkeypatch.setattr(cls, "__call__", lambda self, ids, s: pytest.fail(f"{type(self).__name__} called"))
    if same_settings:  # (else row 3's two-token sequence bias is HF's own call)
        monkeypatch.setattr(SequenceBiasLogitsProcessor, "__call__", lambda self, ids, s: pytest.fail("called"))
    got = _processed(lists, scores)
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))  # (bitwise: -0.0 stays -0.0)


def test_the_block_is_touched_a_fixed_number_of_times_whatever_the_batch():
    """A call's rows each hold their own processor objects, equal in settings: the ids bans and the single-token
    bias must touch the [R, T, V + 1] block a fixed number of times, not once per row (grouping the rows by processor
    object made that quadratic in the batch: 60 s for a 6-case sampling sweep of batch ~1000)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from speculative_kernels.generation.block_processors import block_tokens, fast_op

    class BlockOps(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.count = numel, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [a for a in args if isinstance(a, torch.Tensor)]
            self.count += any(t.numel() >= self.numel for t in flat)
            return func(*args, **(kwargs or {}))

    def block_ops(rows: int) -> int:
        contexts = [torch.tensor([[3, 4, 5, 8, 4, 5]]) for _ in range(rows)]
        block = block_tokens(contexts, torch.tensor([[4, 5, 4, 5]]).expand(rows, -1), T)
        x = torch.randn(rows, T, V + 1)
        made = [(lambda: MinLengthLogitsProcessor(12, EOS)), (lambda: SuppressTokensLogitsProcessor([3, 9])),
                (lambda: SuppressTokensAtBeginLogitsProcessor([1], 6)),
                (lambda: _prepared(SequenceBiasLogitsProcessor({(5,): -3.0, (9,): 2.5})))]
        mode = BlockOps(x.numel())
        for make in made:
            processors = [make() for _ in range(rows)]  # (one object per row, as a call's rows get)
            op = fast_op(processors[0])
            with mode:
                op(x, block, processors)
        return mode.count

    assert block_ops(16) == block_ops(2)


def test_rows_of_a_subset_are_processed_and_the_others_left_alone():
    lists, scores = _lists(False), _scores(1)
    expected = _per_row_reference(lists, scores)
    logits = scores.clone()
    contexts = [torch.tensor([c]) for c in CONTEXTS]
    RowProcessors(lists).process(logits, contexts, DRAFTS, [1, 3])
    assert torch.equal(logits[[1, 3]], expected[[1, 3]]) and torch.equal(logits[[0, 2]], scores[[0, 2]])


class _RaiseAfter(LogitsProcessor):
    """A caller's processor that raises once input_ids are longer than ``length`` (a context with drafts)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] > self.length:
            raise KeyError("no such prefix")
        return scores


def test_a_row_capped_by_a_per_row_stage_keeps_its_position_finite_through_later_block_stages():
    """Row 1's own processor raises at position 2: the row is capped there (``RowProcessors.process``), position 2
    holds 0 (finite: a token drawn there is dropped), and the suppressed-token stage after it leaves that position
    and the later ones as they were; the other rows are processed as HF's calls process them."""
    lists = [[RepetitionPenaltyLogitsProcessor(1.3), _RaiseAfter(len(c) + (1 if b == 1 else T)),
              SuppressTokensLogitsProcessor(list(range(V)))] for b, c in enumerate(CONTEXTS)]
    scores = _scores(3)
    logits = scores.clone()
    caps = RowProcessors(lists).process(logits, [torch.tensor([c]) for c in CONTEXTS], DRAFTS, [0, 1, 2, 3])
    assert caps == {1: 2}
    assert torch.equal(logits[1, 2], torch.zeros(V))
    expected = _per_row_reference([p if b != 1 else p[:1] for b, p in enumerate(lists)], scores)
    assert torch.equal(logits[1, 3:], expected[1, 3:])  # (the penalty's stage only)
    assert torch.isneginf(logits[[0, 2, 3]]).all() and torch.isneginf(logits[1, :2]).all()


def test_a_bias_processor_before_its_first_call_is_prepared_by_hf_own_call():
    """Its first call checks its ids against the vocabulary (and builds its bias): HF's own, per row, so an id past V
    is named by HF's ValueError, as in model.generate; after it, the block path applies the bias."""
    contexts = [torch.tensor([c]) for c in CONTEXTS]
    with pytest.raises(ValueError, match="vocabulary size"):
        RowProcessors([[NoBadWordsLogitsProcessor([[V + 1]])]] * 4).process(_scores(), contexts, DRAFTS, [0, 1, 2, 3])
    lists = [[NoBadWordsLogitsProcessor([[3], [V - 1]])]] * 4
    expected = _per_row_reference(lists, _scores())
    got = _processed(lists, _scores())
    assert torch.equal(got, expected) and (expected == float("-inf")).sum() == 2 * 4 * T
    assert torch.equal(torch.signbit(got), torch.signbit(expected))  # (HF adds its +0.0 bias everywhere: no -0.0)


@pytest.mark.parametrize("penalty", [True, False])
def test_an_id_past_the_vocabulary_is_treated_as_the_installed_transformers_treats_it(penalty, monkeypatch):
    """transformers 5.24 leaves an id past the output vocabulary out of the penalty and the n-gram ban; 5.17 indexes
    with it and raises: in the context (the penalty), the error propagates as in model.generate; in a ban that only
    a draft brings (row 2's "5" at position 1), the row is capped there (``RowProcessors.process``). The block path
    gives what the per-row path gives, either way."""
    contexts = [c[:] for c in CONTEXTS]
    contexts[2][3] = contexts[2][5] = V + 3  # (a repeated bigram "5 X" with X past V; a penalised id past V)

    def outcome(per_row: bool):
        lists = [[RepetitionPenaltyLogitsProcessor(1.3)] * penalty + [NoRepeatNGramLogitsProcessor(2)]
                 for _ in contexts]
        with monkeypatch.context() as m:
            if per_row:
                m.setattr(context_processors, "split_into_stages", lambda ps: [(False, tuple(ps))])
            logits = _scores(2)
            try:
                caps = RowProcessors(lists).process(logits, [torch.tensor([c]) for c in contexts], DRAFTS,
                                                    list(range(len(contexts))))
            except (IndexError, RuntimeError) as error:
                return type(error)
        return caps, logits

    expected, got = outcome(per_row=True), outcome(per_row=False)
    if isinstance(expected, tuple):
        assert got[0] == expected[0] and torch.equal(got[1], expected[1])
    else:
        assert got is expected


def test_greedy_batch_identical_to_model_generate():
    """The target as its own draft (its unprocessed argmax): the drafts repeat, and a reward for repeating
    (penalty < 1) turns on the block's own drafts before each position."""
    target = llama()
    ids = torch.tensor([[0, 0, 84, 39, 64, 30, 63], [5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 3, 4, 5]])
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, attention_mask=(ids != 0).long(),
                    repetition_penalty=0.7, no_repeat_ngram_size=2, min_new_tokens=4, eos_token_id=2)
    expected = hf_generate(target, ids, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=4, **settings)
    assert torch.equal(got, expected)
