"""HF's most common logits processors over a whole speculative block at once: logits [R, T, V], every row and
position in a few tensor ops, with exactly the scores that calling the processor per row and position gives
(``context_processors.RowProcessors``' per-row path: position j of row r processed with input_ids [1, L_r + j],
the row's L_r tokens so far and the block's first j drafts).

Which: HF's repetition penalty, n-gram ban, minimum length, minimum new tokens, suppressed tokens, suppressed
tokens at the first position, and sequence bias / bad words of single tokens (``fast_op``), whose class is exactly
HF's and whose settings are of the types HF's ``generate`` builds them with; anything else (a subclass, a caller's
processor, sequence bias and bad words with longer sequences, whose float sums follow each transformers version's
own order) is called per row. Each op does the float operations
HF's ``__call__`` does, elementwise on the same values with the same scalar operands (``x * penalty``,
``x / penalty`` with the Python float, ``-inf`` fills), so the processed scores are bit-identical; the parts that
differ between transformers versions are read off the installed one (``_CLAMPS_*``). An id HF's own indexing
would refuse raises here too (scatter's bounds check), and the caller then runs the processors per row, which does
what HF does.
"""

import math
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
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

from .transfer import host_to_device


@dataclass
class BlockTokens:
    """What each position of a block is processed with, for R rows at once.

    tokens: [R, W] int64, row r's context (its L_r tokens so far), then its T - 1 drafts, then filler (0);
    lengths: [R] int64, L_r; cur: [R, T] int64, L_r + j, the length of input_ids at position j."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    cur: torch.Tensor


def block_tokens(contexts: list, block: torch.Tensor | None, width: int) -> BlockTokens:
    """contexts: R tensors [1, L_r] int64 (the rows' tokens so far); block [R, >= width - 1] int64 (the drafts at
    positions 0..width-2; None when width is 1)."""
    device = contexts[0].device
    tokens = pad_sequence([c[0] for c in contexts], batch_first=True, padding_value=0)
    lengths = host_to_device([c.shape[1] for c in contexts], torch.int64, device)
    if width > 1:
        tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], width - 1)], dim=1)
        columns = lengths[:, None] + torch.arange(width - 1, device=device)
        tokens.scatter_(1, columns, block[:, : width - 1])
    return BlockTokens(tokens, lengths, lengths[:, None] + torch.arange(width, device=device))


def _groups(processors: list, key) -> list:
    """[(a processor of the group, its rows: a host list of R bools, or None for all rows)]: the rows' processors
    grouped by ``key`` (their settings; one group in a call's batch, several in a batch of requests)."""
    keys = [key(p) for p in processors]
    if all(k == keys[0] for k in keys):
        return [(processors[0], None)]
    groups = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    return [(processors[members[0]], [r in members for r in range(len(keys))]) for members in groups.values()]


def _rows_mask(rows: list | None, device, dims: int) -> torch.Tensor | None:
    """[R, 1, ...] bool (``dims`` dimensions) of a group's rows (None: all)."""
    return None if rows is None else host_to_device(rows, torch.bool, device).reshape(-1, *([1] * (dims - 1)))


def _row_values(processors: list, read, device) -> torch.Tensor:
    """[R] int64: ``read(p)`` of each row's processor."""
    return host_to_device([int(read(p)) for p in processors], torch.int64, device)


def _fill(x: torch.Tensor, where: torch.Tensor, ids: torch.Tensor) -> None:
    """-inf in place at x[r, j, ids[k]] for where[r, j] (HF's ``where(isin(arange(V), ids), -inf, scores)`` at those
    positions; ids outside [0, V) match nothing there, so they go to the spare column V here)."""
    spare = x.shape[-1] - 1
    ids = ids.to(x.device, torch.int64).reshape(-1)
    ids = torch.where((ids >= 0) & (ids < spare), ids, spare)
    x.scatter_(2, torch.where(where[..., None], ids, spare), -math.inf)


# ------------------------------------------------------------------------------------------------ the processors
# Each op: fn(x [R, T, V + 1] float32, the scores with a spare last column, edited in place; BlockTokens; the rows'
# processors, one per row, of one class).
def _repetition_penalty(x: torch.Tensor, block: BlockTokens, processors: list) -> None:
    """Penalised where the token is among the position's input_ids (less a row's ignored first
    ``prompt_ignore_length`` ids): HF's gather, ``where(score < 0, score * penalty, score / penalty)``, scatter,
    with each position's ids [R, T, W] (the others at the spare column)."""
    spare, device, tokens = x.shape[-1] - 1, x.device, block.tokens
    # Ids past the output vocabulary: transformers >= 5.24 leaves them out (the spare column); older ones index
    # with them, which raises: -1 makes the gather below raise there too
    ids = tokens.clamp(max=spare) if _CLAMPS_PENALTY else tokens.masked_fill(tokens >= spare, -1)
    columns = torch.arange(tokens.shape[1], device=device)
    ignore = _ignore_lengths(processors, device)  # [R]
    seen = (columns < block.cur[..., None]) & (columns >= ignore[:, None, None])  # [R, T, W]
    index = torch.where(seen, ids[:, None, :], spare)
    score = x.gather(2, index)
    for processor, rows_in in _groups(processors, lambda p: p.penalty):
        penalty = processor.penalty
        penalised = torch.where(score < 0, score * penalty, score / penalty)
        mask = _rows_mask(rows_in, device, 3)
        score = penalised if mask is None else torch.where(mask, penalised, score)
    x.scatter_(2, index, score)


def _ignore_lengths(processors: list, device) -> torch.Tensor:
    """[R] int64: each row's ``prompt_ignore_length`` (None: 0; an int; a one-row tensor, as 5.24's generate builds
    from the row's attention mask: its left padding)."""
    values = [p.prompt_ignore_length for p in processors]
    if all(not isinstance(v, torch.Tensor) for v in values):
        return host_to_device([v or 0 for v in values], torch.int64, device)
    return torch.cat([v.to(device, torch.int64) if isinstance(v, torch.Tensor)
                      else torch.tensor([v or 0], device=device) for v in values])


def _no_repeat_ngram(x: torch.Tensor, block: BlockTokens, processors: list) -> None:
    """-inf at each token that would complete an n-gram already in the position's input_ids."""
    for processor, rows_in in _groups(processors, lambda p: p.ngram_size):
        _ban_ngrams(x, block, processor.ngram_size, _rows_mask(rows_in, x.device, 3))


def _ban_ngrams(x: torch.Tensor, block: BlockTokens, n: int, rows_in: torch.Tensor | None) -> None:
    """At position j of row r, -inf at the last tokens of the n-token windows inside its input_ids
    (tokens[r, : cur]) whose first n - 1 tokens are the input_ids' last n - 1 (HF's rule)."""
    tokens, cur = block.tokens, block.cur
    rows, steps = cur.shape
    if tokens.shape[1] < n:  # (no window fits)
        return
    device, spare = tokens.device, x.shape[-1] - 1
    windows = tokens.unfold(1, n, 1)  # [R, S, n]
    suffix = (cur[..., None] - (n - 1) + torch.arange(n - 1, device=device)).clamp(min=0)  # [R, T, n - 1]
    suffix = tokens.gather(1, suffix.reshape(rows, -1)).reshape(rows, steps, n - 1)
    matches = (windows[:, None, :, :-1] == suffix[:, :, None, :]).all(dim=-1)  # [R, T, S]
    starts = torch.arange(windows.shape[1], device=device)
    matches &= starts + n <= cur[..., None]  # (whole windows before position j only)
    if rows_in is not None:
        matches &= rows_in
    last = windows[..., -1]
    if _CLAMPS_NGRAM:  # (else an id past V + 1 raises in the scatter, as in HF's)
        last = last.clamp(max=spare)
    x.scatter_(2, torch.where(matches, last[:, None, :], spare), -float("inf"))


def _id_matrix(processors: list, ids, device) -> torch.Tensor:
    """The ids ``ids(p)`` of each row's processor: [K] when there is one row, else [R, K] padded with -1 (which
    matches nothing): one tensor whatever the number of distinct processor objects (a call's rows each hold their
    own, equal ones: grouping them by object made this quadratic in the batch)."""
    per_row = [ids(p).to(device, torch.int64).reshape(-1) for p in processors]
    if len(per_row) == 1:
        return per_row[0]
    return pad_sequence(per_row, batch_first=True, padding_value=-1)


def _ban_ids(x: torch.Tensor, where: torch.Tensor, matrix: torch.Tensor) -> None:
    """-inf at the ids of ``matrix`` (``_id_matrix``) at the positions ``where`` [R, T] bool: one scatter."""
    if matrix.dim() == 1:
        _fill(x, where, matrix)
        return
    spare = x.shape[-1] - 1
    matrix = torch.where((matrix >= 0) & (matrix < spare), matrix, spare)
    x.scatter_(2, torch.where(where[..., None], matrix[:, None, :], spare), -math.inf)


# Id bans in two parts: ``_prepare_*`` builds the rows' values and ids once, on the device (what a block op needs
# of its processors), and returns the op over (x, block). A block op is prepared and run at once; the draft's bans
# (``draft_processors``) prepare once per iteration and run at every draft step.
def _prepare_min_length(processors: list, device):
    """EOS banned while input_ids are shorter than min_length."""
    least = _row_values(processors, lambda p: p.min_length, device)[:, None]
    eos = _id_matrix(processors, lambda p: p.eos_token_id, device)
    return lambda x, block: _ban_ids(x, block.cur < least, eos)


def _prepare_min_new_tokens(processors: list, device):
    """EOS banned while fewer than min_new_tokens follow the prompt_length_to_skip first ids."""
    skip = _row_values(processors, lambda p: p.prompt_length_to_skip, device)[:, None]
    least = _row_values(processors, lambda p: p.min_new_tokens, device)[:, None]
    eos = _id_matrix(processors, lambda p: p.eos_token_id, device)
    return lambda x, block: _ban_ids(x, block.cur - skip < least, eos)


def _prepare_suppress_tokens(processors: list, device):
    """The suppressed ids -inf at every position."""
    ids = _id_matrix(processors, lambda p: p.suppress_tokens, device)
    return lambda x, block: _ban_ids(x, torch.ones(block.cur.shape, dtype=torch.bool, device=x.device), ids)


def _prepare_suppress_tokens_at_begin(processors: list, device):
    """The suppressed ids -inf where input_ids are begin_index long."""
    begin = _row_values(processors, lambda p: p.begin_index, device)[:, None]
    ids = _id_matrix(processors, lambda p: p.begin_suppress_tokens, device)
    return lambda x, block: _ban_ids(x, block.cur == begin, ids)


class Unprepared(RuntimeError):
    """A bias processor before its first call (which checks its ids against the vocabulary and builds its bias):
    that call is left to HF's own code, per row."""


def _prepare_single_token_bias(processors: list, device):
    """Sequence bias / bad words of single tokens only: scores + bias, the bias HF's builds at every call (zeros plus
    its length-1 bias [V]: the biases, -inf for bad words), built at the first run (after the processors' own first
    call: ``Unprepared`` before) and kept for the later ones."""
    built = []

    def run(x, block: BlockTokens) -> None:
        scores = x[..., :-1]
        if not built:
            for processor in processors:
                if not processor.prepared_bias_variables:
                    raise Unprepared(type(processor).__name__)
            distinct = {id(p): p for p in processors}
            if len(distinct) == 1:
                bias = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=x.device)
                bias += processors[0].length_1_bias
            else:  # [R, 1, V]: each row's bias built as HF builds it (zeros + its length-1 bias), one add
                bias = torch.zeros(len(processors), 1, scores.shape[-1], dtype=scores.dtype, device=x.device)
                bias += torch.stack([p.length_1_bias.to(x.device) for p in processors])[:, None, :]
            built.append(bias)
        scores.add_(built[0])

    return run


def _run_prepared(prepare):
    """The block op (x, block, processors) of a ``_prepare_*``: prepared and run at once."""
    def op(x: torch.Tensor, block: BlockTokens, processors: list) -> None:
        prepare(processors, x.device)(x, block)
    op.prepare = prepare
    op.__doc__ = prepare.__doc__
    return op


_min_length = _run_prepared(_prepare_min_length)
_min_new_tokens = _run_prepared(_prepare_min_new_tokens)
_suppress_tokens = _run_prepared(_prepare_suppress_tokens)
_suppress_tokens_at_begin = _run_prepared(_prepare_suppress_tokens_at_begin)
_single_token_bias = _run_prepared(_prepare_single_token_bias)


def prepared(op, processors: list, device):
    """``op`` (a ``fast_op``) over the rows' ``processors``, as a function of (x [R, T, V + 1], BlockTokens) with
    what it reads of the processors built once (the id bans and the single-token bias; the others read them at
    each run): for a block op run many times on the same rows (the draft's bans, at each draft step)."""
    prepare = getattr(op, "prepare", None)
    if prepare is not None:
        return prepare(processors, device)
    return lambda x, block: op(x, block, processors)


# ------------------------------------------------------------------------------------------------ eligibility
def _int(value) -> bool:
    return type(value) is int and value >= 0


def _ids(value) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() <= 1


def _single_tokens(sequence_bias) -> bool:
    """Biases of single tokens only (longer sequences: their sums follow each transformers version's own order)."""
    return isinstance(sequence_bias, dict) and all(type(k) is tuple and len(k) == 1 for k in sequence_bias)


def _ignore_ok(value) -> bool:
    """None, an int, or a one-row integer tensor (what HF's generate builds, per transformers version)."""
    if value is None or _int(value):
        return True
    return isinstance(value, torch.Tensor) and value.shape == (1,) and not value.is_floating_point()


_OPS = {
    RepetitionPenaltyLogitsProcessor: (
        _repetition_penalty,
        lambda p: type(p.penalty) is float and p.penalty > 0 and _ignore_ok(p.prompt_ignore_length)),
    NoRepeatNGramLogitsProcessor: (_no_repeat_ngram, lambda p: _int(p.ngram_size) and p.ngram_size > 0),
    MinLengthLogitsProcessor: (_min_length, lambda p: _int(p.min_length) and _ids(p.eos_token_id)),
    MinNewTokensLengthLogitsProcessor: (
        _min_new_tokens,
        lambda p: _int(p.prompt_length_to_skip) and _int(p.min_new_tokens) and _ids(p.eos_token_id)),
    SuppressTokensLogitsProcessor: (_suppress_tokens, lambda p: _ids(p.suppress_tokens)),
    SequenceBiasLogitsProcessor: (_single_token_bias, lambda p: _single_tokens(p.sequence_bias)),
    NoBadWordsLogitsProcessor: (_single_token_bias, lambda p: _single_tokens(p.sequence_bias)),
    SuppressTokensAtBeginLogitsProcessor: (
        _suppress_tokens_at_begin, lambda p: _int(p.begin_index) and _ids(p.begin_suppress_tokens)),
}


def fast_op(processor):
    """The block op for ``processor`` (see "the processors" above), or None
    where it is called per row: its class is not exactly one of HF's handled here, or a setting is of a type HF's
    generate does not build it with."""
    entry = _OPS.get(type(processor))
    if entry is None:
        return None
    op, eligible = entry
    try:
        return op if eligible(processor) else None
    except AttributeError:  # (a transformers whose processor lacks an attribute read here)
        return None


def _clamps_out_of_vocab_ids(processor) -> bool:
    """Whether the installed transformers' ``processor`` skips an id past the output vocabulary (>= 5.24: clamped to
    a spare column) rather than indexing with it (older: an index error)."""
    try:
        processor(torch.tensor([[3]]), torch.zeros(1, 2))
    except (IndexError, RuntimeError):
        return False
    return True


_CLAMPS_PENALTY = _clamps_out_of_vocab_ids(RepetitionPenaltyLogitsProcessor(2.0))
_CLAMPS_NGRAM = _clamps_out_of_vocab_ids(NoRepeatNGramLogitsProcessor(1))

__all__ = ["BlockTokens", "Unprepared", "block_tokens", "fast_op", "prepared"]
