"""Host-side text bookkeeping of the re-tokenizing drafter (``retokenizing_drafter.py``): one row's text, the
target's tokens of it and the draft's own tokens of it, kept in step incrementally with two lookbehind windows
(HF's ``target_lookbehind`` and ``assistant_lookbehind``, default 10 each).

Everything here is plain Python on host ints and strings (tokenizer calls): the work of universal assisted generation
(UAD) that HF also does on the host at every iteration. None of it decides what the output is: the target verifies
every proposal, so a poor re-tokenization lowers the acceptance rate and nothing else.

Marks tie the three together: a mark (i, j, c) says target_ids[:i] decodes to text[:c] and draft_ids[:j] encodes
text[:c]. New target tokens are decoded together with the target tokens since the latest mark at least
``target_lookbehind`` tokens back (a token's text may depend on the one before: a byte-level character split over two
tokens, a word-initial space), and the draft's tokens from that mark on are re-encoded from the text (a new word may
merge with the last tokens); the draft's cache keeps what did not change (``DraftSlots``). Draft tokens become target
tokens the same way: decoded with the draft tokens since the latest mark at least ``assistant_lookbehind`` tokens
back, and the text since that mark re-encoded with the target's tokenizer; the tokens past the target's own are the
proposal.

Two details make a window's text and tokens those of the whole sequence: new tokens' text is what they add to the
decoding of the window's earlier tokens (decoded with and without them: a SentencePiece decoder strips the first
space of whatever it decodes), and a piece of text encoded mid-sequence is encoded after ``ANCHOR`` whose tokens are
then dropped (a Llama 2 normalizer prepends "▁" to whatever it encodes: each window would add a space).
"""

import dataclasses

REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of a character split across tokens
# Text put before a piece encoded mid-sequence, whose tokens are then dropped: SentencePiece-style tokenizers
# (Llama 2's "Prepend ▁" normalizer) otherwise start every piece with a word-initial space of their own
ANCHOR = "\n"


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _encode(tokenizer, text: str, first: bool, anchor: list[int]) -> list[int]:
    """Token ids of ``text``: at the start of the sequence (first: with the tokenizer's special tokens, e.g. BOS),
    or in the middle of it (encoded after ANCHOR, whose tokens ``anchor`` are dropped, where they are a prefix)."""
    if first:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not text:
        return []
    ids = list(tokenizer(ANCHOR + text, add_special_tokens=False)["input_ids"])
    if anchor and ids[: len(anchor)] == anchor:
        return ids[len(anchor):]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def added_text(tokenizer, context: list[int], new: list[int]) -> str | None:
    """The text ``new`` adds after ``context`` (both token ids): decoded with and without it (a decoder may treat a
    sequence's first token apart, e.g. strip its leading space), or None where the first is no prefix of the other."""
    before, after = _decode(tokenizer, context), _decode(tokenizer, context + new)
    return after[len(before):] if after.startswith(before) else None


@dataclasses.dataclass(frozen=True)
class TokenizerPair:
    """The target's and the draft's tokenizers with the call's settings. target_lookbehind, assistant_lookbehind:
    HF's (ints >= 0); draft_eos: the draft's EOS ids (a draft stops proposing at one); target_eos: the target id
    proposed in its place (None: nothing); starter: a draft id to start from when the prompt's text encodes to no
    draft token at all (the draft needs one input); target_width: the target's logit width V (None: any id), a
    proposal ending before the first id its tokenizer gives outside [0, V) (a tokenizer with more ids than the
    model's head: ids the target can never emit, which the loop refuses as a drafter's bad proposal)."""

    target: object
    draft: object
    target_lookbehind: int = 10
    assistant_lookbehind: int = 10
    draft_eos: frozenset = frozenset()
    target_eos: int | None = None
    starter: int = 0
    target_width: int | None = None

    def __post_init__(self):
        for side in ("target", "draft"):  # each tokenizer's tokens of ANCHOR, once
            tokenizer = getattr(self, side)
            object.__setattr__(self, f"_{side}_anchor", list(tokenizer(ANCHOR, add_special_tokens=False)["input_ids"]))

    def decode_target(self, ids: list[int]) -> str:
        return _decode(self.target, ids)

    def encode_target(self, text: str, first: bool) -> list[int]:
        """first: the text starts the sequence (the tokenizer's special tokens, e.g. BOS, are added)."""
        return _encode(self.target, text, first, self._target_anchor)

    def encode_draft(self, text: str, first: bool) -> list[int]:
        return _encode(self.draft, text, first, self._draft_anchor) or ([self.starter] if first else [])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


class RowText:
    """One row on the host: target_ids (its real prompt tokens, then every emitted token), text (the target's
    decoding of target_ids[:synced], special tokens skipped as in HF), draft_ids (the draft's tokens of text) and
    the marks (i, j, c) of the module docstring, in increasing order."""

    def __init__(self, pair: TokenizerPair, prompt: list[int]):
        self.pair = pair
        self.target_ids = list(prompt)
        self.text = pair.decode_target(self.target_ids)
        self.synced = len(self.target_ids)
        self.draft_ids = pair.encode_draft(self.text, first=True)
        self.marks = [(0, 0, 0), (self.synced, len(self.draft_ids), len(self.text))]
        self.unchanged = 0  # draft_ids[:unchanged] has not changed since the last ``take_unchanged``

    def take_unchanged(self) -> int:
        """How many first draft ids have not changed since the last call (the draft's cache compares its tokens
        from there on only: host work per iteration bounded by the lookbehind, not the row's length)."""
        unchanged, self.unchanged = self.unchanged, len(self.draft_ids)
        return unchanged

    def _mark_before(self, index: int, limit: int) -> tuple[int, int, int]:
        """The latest mark whose entry ``index`` (0: target, 1: draft) is at most ``limit`` and that leaves some
        text after it (or the first): new tokens' text is what they add to the decoding of the window's earlier
        ones, and a window of no text (a lookbehind of 0, only special tokens) has a decoder strip the new text's
        first space as the start of a sequence (SentencePiece's)."""
        for mark in reversed(self.marks):
            if mark[index] <= limit and mark[2] < len(self.text):
                return mark
        return self.marks[0]

    def extend(self, new_ids: list[int]) -> None:
        """The target emitted new_ids: extend the text, and re-encode the draft's tokens from a mark at least
        target_lookbehind target tokens back. Tokens whose text is not complete yet (a character split across
        tokens) wait for the next ones."""
        self.target_ids.extend(new_ids)
        i0, j0, c0 = self._mark_before(0, self.synced - self.pair.target_lookbehind)
        added = added_text(self.pair.target, self.target_ids[i0 : self.synced], self.target_ids[self.synced:])
        if added is None:  # decoding depends on more context: decode the whole row
            whole = self.pair.decode_target(self.target_ids)
            added = whole[len(self.text):] if whole.startswith(self.text) else None
            if added is None and not whole.endswith(REPLACEMENT):  # the text so far changed: start the draft over
                i0, j0, c0 = self.marks[0]
                self.text, self.marks, added = "", self.marks[:1], whole
        if added is None or added.endswith(REPLACEMENT):
            return
        self.text += added
        self.synced = len(self.target_ids)
        tail = self.pair.encode_draft(self.text[c0:], first=j0 == 0)
        same = common_prefix(tail, self.draft_ids[j0:])
        del self.draft_ids[j0:]
        self.draft_ids.extend(tail)
        self.unchanged = min(self.unchanged, j0 + same)
        while self.marks[-1][1] > j0 + same:  # marks inside the draft tokens that stayed the same are still marks
            self.marks.pop()
        mark = (self.synced, len(self.draft_ids), len(self.text))
        if mark != self.marks[-1]:
            self.marks.append(mark)

    def proposal(self, drafts: list[int], gamma: int) -> list[int]:
        """The target tokens (at most gamma) that continue target_ids with the text of the draft's tokens
        ``drafts`` (which follow draft_ids); [] when there are none."""
        if self.synced < len(self.target_ids):  # a character still incomplete: the text has no clean end
            return []
        cut = next((k for k, t in enumerate(drafts) if t in self.pair.draft_eos), None)
        words = drafts if cut is None else drafts[:cut]
        i1, j1, c1 = self._mark_before(1, len(self.draft_ids) - self.pair.assistant_lookbehind)
        known = self.text[c1:]
        new_text = (added_text(self.pair.draft, self.draft_ids[j1:], words) or "").rstrip(REPLACEMENT)
        tokens = []
        if new_text:
            window = self.pair.encode_target(known + new_text, first=i1 == 0)
            have = self.target_ids[i1:]
            if window[: len(have)] == have:
                tokens = window[len(have):]
            else:  # the new text merges with the target's last tokens: propose its own tokens
                tokens = self.pair.encode_target(new_text, first=False)
        width = self.pair.target_width
        valid = next((k for k, t in enumerate(tokens) if width is not None and not 0 <= t < width), None)
        if valid is not None:  # (the text past it is not proposed, nor the EOS after that text)
            return tokens[:valid][:gamma]
        if cut is not None and self.pair.target_eos is not None:
            tokens = tokens + [self.pair.target_eos]
        return tokens[:gamma]
