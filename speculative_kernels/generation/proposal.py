"""Checking what a ``Drafter`` proposes before the target runs on it.

The loop trusts the shapes of nothing it did not make: every proposal's shapes, dtypes and device are checked on
the host (attribute reads, no device op), so a drafter returning another width than gamma fails by name instead of
desynchronising the loop's bookkeeping (which gave other tokens, silently). The values of a drafter that is not
one of this package's (a user's ``Drafter``, the n-gram drafter) are checked on the device, with no host read:
ids outside [0, V) at proposed positions, a proposed token its own q gives probability 0 (it could not have been
drawn from q), counts outside 0..gamma. Such a row is flagged; the iteration's one read finds it and the
loop raises ``describe_bad_proposal``'s reason (a batch of separate requests fails that request alone). Fillers
past a row's count may hold any id: they are clamped into the vocabulary for the target's forward and never
accepted.
"""

import numbers

import torch

from ..ops.validation import LOGIT_DTYPES, indexed_device


def drafter_name(drafter) -> str:
    return type(drafter).__name__


def check_proposal(drafter, tokens, logits, num_draft, *, batch: int, gamma: int, vocab: int,
                   device: torch.device) -> None:
    """Raise TypeError/ValueError naming the drafter when ``propose(gamma, ...)``'s (tokens, logits, num_draft)
    are not (tokens [B, gamma] int64, logits [B, gamma, V] float32/float16/bfloat16 or None, num_draft [B] int64 or
    None) on ``device``."""
    where = f"{drafter_name(drafter)}.propose({gamma}, ...)"
    expected = {"tokens": ((batch, gamma), (torch.int64,), "[B, gamma] int64"),
                "logits": ((batch, gamma, vocab), LOGIT_DTYPES, "[B, gamma, V] float32, float16 or bfloat16 (q is "
                                                                "verified in the dtype it was drawn from)"),
                "num_draft": ((batch,), (torch.int64,), "[B] int64")}
    for name, value in (("tokens", tokens), ("logits", logits), ("num_draft", num_draft)):
        if value is None and name != "tokens":
            continue
        shape, dtypes, what = expected[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} returned {name} of type {type(value).__name__}; it must be a {what} tensor"
                            f"{'' if name == 'tokens' else ' or None'}")
        if tuple(value.shape) != shape or value.dtype not in dtypes:
            raise ValueError(f"{where} returned {name} of shape {tuple(value.shape)} and dtype {value.dtype}; it "
                             f"must be {what}, shape {list(shape)} here (B = {batch}, gamma = {gamma}, V = {vocab})")
        if value.device != indexed_device(device):
            raise ValueError(f"{where} returned {name} on {value.device}; the target runs on {device}")


def check_choose_logits(drafter, logits, i: int, *, batch: int, vocab: int, device: torch.device) -> None:
    """Raise TypeError/ValueError naming the drafter unless the logits it hands ``choose(logits, i)`` are [B, V]
    float32/float16/bfloat16 on ``device`` (attribute reads only; another width or batch failed inside torch)."""
    where = f"{drafter_name(drafter)} called choose(logits, {i}) with logits"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{where} of type {type(logits).__name__}; they must be a [B, V] tensor")
    if tuple(logits.shape) != (batch, vocab) or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"{where} of shape {tuple(logits.shape)} and dtype {logits.dtype}; they must be [B, V] "
                         f"float32, float16 or bfloat16, shape [{batch}, {vocab}] here (one position of every row)")
    if logits.device != indexed_device(device):
        raise ValueError(f"{where} on {logits.device}; the target runs on {device}")


_LENGTH_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_lengths_to_read(drafter, lengths, device: torch.device) -> None:
    """Raise TypeError/ValueError naming the drafter unless its ``lengths_to_read()`` is a 1-D int64 tensor on
    ``device`` (attribute reads only). They ride in the iteration's one host read, concatenated with the emitted
    tokens: a float tensor would turn every token id read into a float (float16/bfloat16: rounded ids, on which the
    EOS and length cuts then run)."""
    where = f"{drafter_name(drafter)}.lengths_to_read()"
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{where} returned {type(lengths).__name__}; it must be a [N] int64 tensor or None")
    if lengths.dim() != 1 or lengths.dtype not in _LENGTH_DTYPES:  # (concatenated to int64: promoted exactly)
        raise ValueError(f"{where} returned a tensor of shape {tuple(lengths.shape)} and dtype {lengths.dtype}; it "
                         "must be [N] int64 (or another signed integer type; it is read on the host with the "
                         "iteration's token ids)")
    if lengths.device != indexed_device(device):
        raise ValueError(f"{where} returned a tensor on {lengths.device}; the target runs on {device}")


def check_proposal_counts(drafter, counts, batch: int) -> list[int] | None:
    """``proposal_counts()``'s value (host, no device op): None, or B ints >= 0 (as a list); else TypeError/ValueError
    naming the drafter (a wrong length failed in the statistics after the target's forward, negative counts called
    ``propose`` with a negative gamma)."""
    if counts is None:
        return None
    where = f"{drafter_name(drafter)}.proposal_counts()"
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__") or isinstance(counts, torch.Tensor):
        raise TypeError(f"{where} returned {type(counts).__name__}; it must be a list of B host ints or None")
    counts = list(counts)
    if len(counts) != batch:
        raise ValueError(f"{where} returned {len(counts)} counts; it must give one per row (B = {batch})")
    if not all(isinstance(c, numbers.Integral) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise ValueError(f"{where} returned {counts[:8]}; counts must be ints >= 0")
    return [int(c) for c in counts]  # (NumPy integers too)


def flag_proposal(tokens: torch.Tensor, logits: torch.Tensor | None, num_draft: torch.Tensor | None,
                  vocab: int, temperature: float | torch.Tensor | None,
                  greedy_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Device values of an untrusted proposal, no host read. temperature: the verification's (a float, or [B]
    float32 with 1 for greedy rows), None when every row is greedy (q is then not read); greedy_rows: [B] bool, the
    rows of a per-row batch decoded greedily, whose q is not checked either (their verification does not read it,
    as a greedy ``generate``'s does not). Returns (tokens clamped
    into [0, V) for the target's forward [B, gamma], bad [B] bool: rows with an id outside the vocabulary, a count
    outside 0..gamma, or a proposed token whose q = softmax(logits / T) is 0 in float32 (a -inf logit, or one so far
    below the others that its probability underflows: it cannot have been drawn from q, and the verification would
    never accept it). Top-k/top-p cuts of q are not checked: ``choose`` draws inside them)."""
    gamma = tokens.shape[1]
    counts = torch.full_like(tokens[:, 0], gamma) if num_draft is None else num_draft
    proposed = torch.arange(gamma, device=tokens.device) < counts.unsqueeze(1)
    safe = tokens.clamp(0, vocab - 1)
    bad = ((safe != tokens) & proposed).any(dim=1) | (counts < 0) | (counts > gamma)
    if logits is not None and temperature is not None:
        z = logits.float() / (temperature if not isinstance(temperature, torch.Tensor) else temperature.view(-1, 1, 1))
        q_at = (z.gather(2, safe.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)).exp()
        q_bad = ((q_at == 0.0) & proposed).any(dim=1)
        bad |= q_bad if greedy_rows is None else q_bad & ~greedy_rows
    return safe, bad


def describe_bad_proposal(drafter, tokens, logits, num_draft, vocab: int, row: int) -> str | None:
    """Why row ``row`` of a flagged proposal is invalid (host reads: called after a failure), or None."""
    where = f"the drafter {drafter_name(drafter)}"
    gamma = tokens.shape[1]
    count = gamma if num_draft is None else int(num_draft[row])
    if not 0 <= count <= gamma:
        return f"{where} proposed num_draft={count} tokens for a row; it must be in 0..gamma = {gamma}"
    ids = tokens[row, :count].tolist()
    outside = [t for t in ids if not 0 <= t < vocab]
    if outside:
        return f"{where} proposed token ids outside the target's vocabulary [0, {vocab}): {outside[:5]}"
    if logits is not None:
        return (f"{where} proposed a token that its own q (softmax of the logits it returned, at the "
                "verification's temperature) gives probability 0: a token must be drawn from the q returned with it")
    return None
