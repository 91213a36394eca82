"""Prompt-lookup drafting (HF's ``prompt_lookup_num_tokens``): a ``Drafter`` without a model that copies the
tokens that followed an earlier occurrence of each row's last n-gram (``ops.prompt_lookup``), on the device: by
default the most recent occurrence of the longest n-gram (n <= max_matching_ngram_size), continued periodically
when its continuation reaches the row's end.

Its proposal has no distribution (q is one-hot at each proposed token: ``ops.verify`` with ``draft_logits=None``),
which is exact because the proposal is a deterministic function of the row's context. Rows propose different
numbers of tokens (none without a match). The next iteration's proposal is computed as soon as the iteration's
tokens are emitted (``observe``), so its per-row counts ride along in that iteration's one host read and the loop
drafts no more tokens than the longest proposal of an unfinished row: with no match anywhere it runs the target
alone, as HF does. In a compiled loop (captured target steps of one width) every iteration drafts the full gamma,
rows without a match padded with fillers.
"""

import torch

from ..ops.lookup import prompt_lookup
from .context import ContextBuffer
from .drafter import ChooseToken, emitted_counts


class PromptLookupDrafter:
    """num_tokens: the most tokens a row proposes (gamma); max_ngram: HF's ``max_matching_ngram_size``; prefix:
    (encoder ids, encoder real) searched too, or None; max_new_tokens sizes the context buffer; compiled: the
    loop's target steps are captured at one width (the buffer is allocated at its final width, every iteration
    drafts gamma tokens); backend: of ``ops.prompt_lookup``; prefer_latest, periodic: the rule (``ops/lookup.py``).
    The default, the most recent match extended periodically, proposed 7-11% more tokens per target forward than
    HF's rule (both False: the first match, cut at the row's end) on the demo benchmark
    (``docs/drafting_without_a_model.md``); greedy output is the same with either."""

    # its ids are in [0, V) by construction (drawn by the loop's choose / copied from the checked context), so
    # the loop checks only its proposal's shapes (``proposal.py``)
    PROPOSES_VALID_IDS = True

    def __init__(self, num_tokens: int, max_ngram: int, *, prefix=None, max_new_tokens: int | None = None,
                 compiled: bool = False, backend: str = "auto", prefer_latest: bool = True, periodic: bool = True):
        self.num_tokens, self.max_ngram, self.prefix = num_tokens, max_ngram, prefix
        self.max_new_tokens, self.compiled = max_new_tokens, compiled
        self.backend, self.prefer_latest, self.periodic = backend, prefer_latest, periodic
        self.context: ContextBuffer | None = None
        self.proposal = self.count = None  # the next proposal: [B, num_tokens], [B] on the device
        self._count_host: list[int] | None = None  # its counts, once read on the host

    def _look_up(self) -> None:
        c = self.context
        self.proposal, self.count = prompt_lookup(c.tokens, c.start, c.end, num_tokens=self.num_tokens,
                                                  max_ngram=self.max_ngram, prefer_latest=self.prefer_latest,
                                                  periodic=self.periodic, backend=self.backend,
                                                  check=False)  # the context buffer keeps 0 <= start < end <= W

    def start(self, input_ids: torch.Tensor, real: torch.Tensor) -> None:
        self.context = ContextBuffer(input_ids, real, self.prefix, max_new_tokens=self.max_new_tokens,
                                     max_gamma=self.num_tokens, full=self.compiled)
        self._look_up()

    def propose(self, gamma: int, choose: ChooseToken) -> tuple[torch.Tensor, None, torch.Tensor]:
        """gamma may exceed num_tokens (the loop's gamma when the host counts are unknown, e.g. after a batch-mate
        left, or a drafter built with fewer tokens than the call's gamma): the columns past num_tokens are fillers
        (the proposal's last column repeated), past every row's count."""
        proposal = self.proposal[:, :gamma]
        if gamma > proposal.shape[1]:
            proposal = torch.cat([proposal, proposal[:, -1:].expand(-1, gamma - proposal.shape[1])], dim=1)
        return proposal, None, self.count.clamp(max=gamma)

    def observe(self, out: torch.Tensor, accepted: torch.Tensor | None, finished: torch.Tensor) -> None:
        self.context.append(out, emitted_counts(accepted, finished))
        self._look_up()
        self._count_host = None

    def accept(self, draft_tokens, accepted, accepted_host, next_token, finished) -> None:
        """Nothing to roll back: ``observe`` has appended what was emitted."""

    def proposal_counts(self) -> list[int] | None:
        return None if self.compiled else self._count_host

    def select_rows(self, index: torch.Tensor) -> None:
        self.context.select_rows(index)
        self.proposal, self.count = self.proposal.index_select(0, index), self.count.index_select(0, index)
        self._count_host = None  # host rows no longer line up; the next iteration drafts the full gamma

    def lengths_to_read(self) -> torch.Tensor:
        return torch.cat([self.context.end, self.count])

    def lengths_read(self, lengths: list[int]) -> None:
        half = len(lengths) // 2
        self.context.lengths_read(lengths[:half])
        self._count_host = lengths[half:]

    @property
    def forwards(self) -> int:
        return 0

    @property
    def compactions(self) -> int:
        return 0

    def add_rows(self, other: "PromptLookupDrafter") -> None:
        """Append ``other``'s rows (a prompt-lookup drafter with the same rule, started on them): their contexts
        and next proposals. Drafters of different widths (``num_tokens``, capped by their rows' max_new_tokens) look
        up every row again at the larger (a row's proposal at a smaller width is a prefix of it, and no row is
        drafted more than its own tokens left less one). The host counts no longer line up (None until the next
        read, as after ``select_rows``)."""
        if not isinstance(other, PromptLookupDrafter) or other.context is None or self.context is None or \
                (other.max_ngram, other.prefer_latest, other.periodic, other.compiled) != \
                (self.max_ngram, self.prefer_latest, self.periodic, self.compiled):
            raise ValueError("add_rows needs another started PromptLookupDrafter with the same settings")
        if other.num_tokens == self.num_tokens:
            proposal, count = torch.cat([self.proposal, other.proposal]), torch.cat([self.count, other.count])
            self.context.add_rows(other.context)
            self.proposal, self.count = proposal, count
        else:
            self.context.add_rows(other.context)
            self.num_tokens = max(self.num_tokens, other.num_tokens)
            self._look_up()
        self._count_host = None
