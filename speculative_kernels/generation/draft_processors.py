"""HF's banning logits processors on the draft's logits too, at every draft step (``DraftProcessors``).

Why: a processor that bans what the target would say (``no_repeat_ngram_size``: the demo pair repeats itself, and
the ban turns the target away from the repeats) makes an unprocessed draft propose exactly the banned tokens, which
the target then rejects: acceptance 0.17-0.29 at batch 1-16 on the demo pair with the ban. Processing draft
position i with the row's tokens so far plus its first i drafts (what the target's position i is processed with)
makes the draft propose what the processed target would (the draft model itself, already conditioned on the
same tokens, is unchanged).

Which processors: the bans among those that ``block_processors`` applies to a whole block (``fast_op``: HF's own
classes, with the settings HF's generate builds), each row's in their order: the n-gram ban, the minimum length and
new tokens (EOS banned), suppressed tokens (everywhere, at the first position) and single-token bad words. A token
the target's processors ban has p = 0 there, so a draft of it is rejected for certain, whatever the two models'
logits: banning it on the draft too removes exactly those rejections. Not the rescaling ones (the repetition
penalty, a factor; the sequence bias, an addition): they move the target's ranking by amounts that suit the target's
logits, and applied to another model's they move its ranking by other amounts. Measured on the demo pair
(greedy, γ = 4, 64 tokens, acceptance without → with the penalty on the draft): ``repetition_penalty=1.05``
0.943 → 0.860 at batch 1 and 0.771 → 0.724 at batch 16, but 1.3 0.235 → 0.318 at batch 4: no consistent gain; the
bans raise it (``no_repeat_ngram_size=3`` 0.248 → 0.361 at batch 16) and never lowered it there. No caller code runs
an extra time: a caller's ``logits_processor``, ``prefix_allowed_tokens_fn``, a watermark and HF's other processors
are not called on the draft's logits. HF's assisted generation does call them there (its assistant generates with
the target's processor list, less ``MinLengthLogitsProcessor``), but ``model.generate``, whose output ours is, calls
them once per emitted token, and a caller's processor may count its calls, keep state, or cost a Python call per row
and draft step.
(They are already called at target positions whose drafts are rejected; see ``context_processors``.)

Exactness: greedy verification does not read q, so processing the drafts changes acceptance only. Sampled, q is the
distribution the draft token was drawn from: ``SpeculativeLoop._choose_draft_token`` processes the logits in place
before drawing, so the drafter stores (and the verification reads) the processed logits. A draft position whose
processing left no admissible token (every logit -inf) keeps its unprocessed logits, so a draw is always valid.

Cost: one [B, 1, V + 1] pass of the block ops per draft step, no host read (host values go to the device only);
what the ops read of each row's processors (ids, lengths, biases: O(rows) small tensors) is built once per iteration
(``block_processors.prepared``), so a draft step's op count does not grow with the batch.
A processor that raises (an id HF's indexing would refuse) is skipped on the draft; the target's processing then
does what HF does. A bad-words processor before its first call is called first as HF calls it (which builds its
bias), as the target's first call would.
"""

import torch
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from .block_processors import BlockTokens, Unprepared, block_tokens, fast_op, prepared
from .transfer import host_to_device


# The bans among ``block_processors``' processors (see the module docstring), by exact class as ``fast_op`` takes them
DRAFT_BANS = (NoRepeatNGramLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
              SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, NoBadWordsLogitsProcessor)


def draft_chain(stages: list) -> tuple:
    """A row's processors that the draft runs, in order: of those ``split_into_stages`` marked fast, the bans."""
    return tuple(processor for fast, processors in stages if fast for processor in processors
                 if type(processor) in DRAFT_BANS)


class _Group:
    """Rows whose draft chains have the same classes: one block pass per draft step. members: their batch rows;
    index: [R] int64 of them (None: every row of the batch, in order); tokens: their ``BlockTokens`` over the
    iteration's gamma - 1 draft columns, filled as the drafts are chosen; chains: per member, its processors;
    ops: per chain position, (the block op with what it reads of the rows' processors built once for the
    iteration, ``block_processors.prepared``, or None where that raised; those processors)."""

    def __init__(self, members: list, batch: int, contexts: list, chains: list, gamma: int, device):
        self.members, self.chains = members, chains
        self.index = None if members == list(range(batch)) else host_to_device(members, torch.int64, device)
        drafts = torch.zeros(len(members), max(gamma - 1, 0), dtype=torch.int64, device=device)
        self.tokens = block_tokens([contexts[b] for b in members], drafts, gamma)
        self.ops = []
        for k in range(len(chains[0])):
            processors = [chain[k] for chain in chains]
            try:
                op = prepared(fast_op(processors[0]), processors, device)
            except (IndexError, RuntimeError, ValueError):  # (skipped on the draft, as a run that raises)
                op = None
            self.ops.append((op, processors))

    def process(self, logits: torch.Tensor, i: int) -> None:
        """Draft position i of the members' rows of logits [B, V], in place."""
        if i >= self.tokens.cur.shape[1]:  # (a drafter of one's own choosing past gamma: left as it is)
            return
        old = logits if self.index is None else logits.index_select(0, self.index)
        x = torch.nn.functional.pad(old.float(), (0, 1)).unsqueeze(1)  # [R, 1, V + 1]: the ops' spare column
        step = BlockTokens(self.tokens.tokens, self.tokens.lengths, self.tokens.cur[:, i : i + 1])
        for op, processors in self.ops:
            try:
                if op is not None:
                    _apply(op, x, step, processors)
            except (IndexError, RuntimeError, ValueError):  # (an id HF's indexing refuses: this one skipped here,
                pass  # the target's processing raises or does what HF does)
        new = x[:, 0, :-1]
        new = torch.where(torch.isneginf(new).all(dim=-1, keepdim=True), old.float(), new).to(logits.dtype)
        if self.index is None:
            logits.copy_(new)
        else:
            logits.index_copy_(0, self.index, new)

    def drafted(self, token: torch.Tensor, i: int) -> None:
        """token [B]: the draft chosen at position i, joining the members' contexts for the positions after it."""
        tokens = self.tokens
        if i + 1 >= tokens.cur.shape[1]:  # (the last draft: no position after it in this iteration)
            return
        mine = token if self.index is None else token.index_select(0, self.index)
        tokens.tokens.scatter_(1, (tokens.lengths + i).unsqueeze(1), mine.unsqueeze(1))


def _apply(op, x: torch.Tensor, step: BlockTokens, processors: list) -> None:
    """op (a prepared block op of ``processors``) over x [R, 1, V + 1] in place; a bias processor before its first
    call (``Unprepared``: the first draft step of a sampled request comes before the target's first processing) is
    first called as HF calls it, on a scratch row, which builds its bias (what the target's first call would do)."""
    try:
        op(x, step)
    except Unprepared:
        scratch = x[:1, 0, :-1].clone()
        for processor in {id(p): p for p in processors}.values():
            if not processor.prepared_bias_variables:
                processor(step.tokens[:1], scratch)
        op(x, step)


class DraftProcessors:
    """One iteration's draft processing: built before the drafter proposes (``start``), then ``process`` on each
    draft position's logits before the draw and ``drafted`` with the token drawn."""

    def __init__(self, groups: list):
        self.groups = groups

    @classmethod
    def start(cls, stages: list, contexts: list, rows: list[int], gamma: int,
              device: torch.device) -> "DraftProcessors | None":
        """stages: each batch row's ``split_into_stages``; contexts[b]: row b's tokens so far, [1, L_b] int64;
        rows: the rows to process (unfinished); gamma >= 1. None when no row has a fast processor."""
        by_classes = {}
        for b in rows:
            chain = draft_chain(stages[b])
            if chain:
                by_classes.setdefault(tuple(type(p) for p in chain), []).append(b)
        if not by_classes:
            return None
        batch = len(stages)
        return cls([_Group(members, batch, contexts, [draft_chain(stages[b]) for b in members], gamma, device)
                    for members in by_classes.values()])

    def process(self, logits: torch.Tensor, i: int) -> None:
        """logits [B, V] of draft position i, processed in place (rows of no group left as they are)."""
        for group in self.groups:
            group.process(logits, i)

    def drafted(self, token: torch.Tensor, i: int) -> None:
        """token [B] int64 in [0, V): the draft chosen at position i."""
        for group in self.groups:
            group.drafted(token, i)


__all__ = ["DRAFT_BANS", "DraftProcessors", "draft_chain"]
