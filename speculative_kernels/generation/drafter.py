"""What proposes the tokens the target verifies (``Drafter``), and the first implementation: a draft model
(``ModelDrafter``). A drafter without a model (prompt lookup: ``lookup_drafter.py``) proposes tokens without a
distribution; the verification then takes q as one-hot at each proposed token, which is exact for a deterministic
proposal. The n-gram drafter (``ngram_drafter.py``) has a distribution; ``python/own_drafter.py`` writes one."""

from collections.abc import Callable
from typing import Protocol

import torch

from .runners import Runner
from .runners.prefill import prefill, prompt_real
from .transfer import host_to_device
from .vocab import VocabBridge

# choose(logits [B, V], i) -> token [B] in [0, V): processes the draft logits of draft position i in place as the
# verifier processes the target's (forced tokens, EOS before min_new_tokens), then draws the token from them.
ChooseToken = Callable[[torch.Tensor, int], torch.Tensor]


def emitted_counts(accepted: torch.Tensor | None, finished: torch.Tensor) -> torch.Tensor:
    """[B] int64: the tokens each row emitted in an iteration (accepted + 1; 1 when nothing was drafted; 0 for a
    row finished before it), from ``Drafter.observe``'s arguments."""
    count = torch.ones_like(finished, dtype=torch.int64) if accepted is None else accepted + 1
    return count.masked_fill(finished, 0)


class Drafter(Protocol):
    """Proposes gamma tokens per row and iteration, conditioned on every row's sequence so far."""

    def start(self, input_ids: torch.Tensor, real: torch.Tensor) -> None:
        """Condition on the prompts input_ids [B, L] (real [B, L] bool: False at left padding, and at tokens the
        attention mask masks inside a prompt, e.g. a pad_token_id there). The last token is not consumed: the next
        ``propose`` starts from it."""

    def propose(self, gamma: int, choose: ChooseToken) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                 torch.Tensor | None]:
        """Draft gamma >= 1 tokens per row. Returns (tokens [B, gamma] int64, logits [B, gamma, V] of the
        distribution q each token was drawn from, as processed by ``choose``, or None for a drafter without one
        (the verification warps them with the request's temperature/top_k/top_p/warpers, as ``choose`` does: draw
        through ``choose``; tokens drawn from softmax(logits) directly are exact only at T = 1 without cuts),
        num_draft [B] int64 in 0..gamma: how many of its tokens row b proposes, or None for all gamma). Tokens past
        num_draft[b] are fillers, never accepted (the loop passes num_draft to ``ops.verify``); the random numbers of
        their ``choose`` draws are given back (row b's draft offsets count its own num_draft[b] draws, as alone) and
        drawn again by the next ``propose``: what it proposes must not depend on the fillers (they are given back
        when ``choose`` was called once per position, gamma times). A row's count must not depend on a token it
        drew and leaves out (a drafter that stops before a drawn EOS is not exact: cut after it, or draw no more)."""

    def observe(self, out: torch.Tensor, accepted: torch.Tensor | None, finished: torch.Tensor) -> None:
        """Right after verification, before the iteration's host read: out [B, T] holds each row's new tokens then
        -1; accepted [B] int64 (device) the drafts each row accepted, in 0..gamma (None when nothing was drafted:
        one token each); finished [B] bool rows that emit nothing in this iteration: those that had finished before
        it, and those whose proposal or verification was invalid (out all -1, accepted 0; the iteration then raises
        the reason, or in a batch of requests fails that request alone).
        ``emitted_counts(accepted, finished)`` gives how many of out each row emitted (a row that finishes in this
        iteration may count tokens past its EOS or length cut: it proposes nothing after). A drafter may prepare
        its next proposal here (and have its counts read)."""

    def proposal_counts(self) -> list[int] | None:
        """Per row, how many tokens the next ``propose`` would propose (host ints from the last host read), or None
        if unknown (always None for a drafter that proposes gamma tokens; None after ``select_rows`` until the next
        read, as the host list no longer lines up with the rows); the loop drafts no more than the largest of an
        unfinished row."""
        return None

    def accept(self, draft_tokens: torch.Tensor, accepted: torch.Tensor, accepted_host: list[int],
               next_token: torch.Tensor, finished: torch.Tensor) -> None:
        """After verification: row b kept its first accepted[b] of draft_tokens [B, gamma] (accepted: [B] int64 on
        the device, accepted_host its host copy) and the target emitted next_token [B] after them; finished [B] bool
        rows keep nothing of this iteration. Roll back to that and get ready for the next ``propose``."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] (int64 on the device) of every per-row state."""
        raise NotImplementedError(f"{type(self).__name__} does not implement Drafter.select_rows, which the loop "
                                  "calls when rows leave the batch (a row finished): keep rows index [B'] of its "
                                  "per-row state (its batch size too)")

    def add_rows(self, other: "Drafter") -> None:
        """Append the rows of ``other`` (a drafter of the same kind, started on its own rows, e.g. requests joining
        a running batch) after this drafter's rows, in every per-row state; ``other`` is consumed. The counterpart
        of ``select_rows``. As after ``select_rows``, ``proposal_counts`` may be None until the next host read. To
        refuse, raise ValueError or NotImplementedError before changing anything: the loop calls this before it
        joins anything else, and the joining requests then end with "error" while the running ones go on."""
        raise NotImplementedError(f"{type(self).__name__} does not implement Drafter.add_rows, which continuous "
                                  "batching calls when requests join a running batch")

    # Optional: a drafter that needs the emitted token ids on the host (re-tokenizing them: ``retokenizing_drafter``)
    # sets READS_EMITTED_TOKENS = True and implements ``emitted_read``; the loop then hands it its own host copy of the
    # iteration's tokens, so no second read is needed for them. Others leave it False and need no such method.
    READS_EMITTED_TOKENS: bool = False

    def emitted_read(self, emitted: list[list[int]], finished: list[int]) -> None:
        """Only for a drafter with READS_EMITTED_TOKENS = True: after the iteration's one host read (and its EOS,
        length and stop-string cuts), emitted[b] lists the token ids row b emitted (host ints; [] for a row that
        emitted nothing) and finished[b] is 1 for a row that has finished (it emits nothing more). Called after
        ``observe`` and before ``accept``, also in an iteration with nothing drafted (no ``accept`` follows)."""

    def lengths_to_read(self) -> torch.Tensor | None:
        """As ``Runner.lengths_to_read``: [N] int64 (any N) wanted from the iteration's host read, or None."""
        return None

    def lengths_read(self, lengths: list[int]) -> None:
        """The values of ``lengths_to_read()`` as read on the host."""

    @property
    def forwards(self) -> int:
        """Model forwards ``propose`` has run so far (0 for a drafter without a model)."""
        return 0

    @property
    def compactions(self) -> int:
        """Hole compactions of its cache so far (0 without one)."""
        return 0


# What the loop calls on every drafter (``select_rows``/``add_rows`` only when rows leave or join)
_CALLED = ("start", "propose", "observe", "accept", "proposal_counts", "lengths_to_read", "lengths_read")


def reads_emitted_tokens(drafter) -> bool:
    """Whether ``drafter`` asks for the emitted tokens on the host (``Drafter.READS_EMITTED_TOKENS`` is True)."""
    return getattr(drafter, "READS_EMITTED_TOKENS", False) is True


def check_drafter(drafter) -> None:
    """TypeError naming what was passed unless ``drafter`` is a ``Drafter`` instance (its methods callable), before
    anything runs: ``generate`` takes an instance, ``SpeculativeDecoder(drafter=...)`` a callable returning a new
    one per session, and a class or a factory passed where the instance goes failed only after the
    target's prefill (``'function' object has no attribute 'start'``)."""
    if isinstance(drafter, type):
        raise TypeError(f"drafter= takes a Drafter instance here; got the class {drafter.__name__}: pass "
                        f"{drafter.__name__}(...) (SpeculativeDecoder(drafter=...) is the one that takes a callable "
                        "returning a new Drafter per session)")
    called = _CALLED + (("emitted_read",) if reads_emitted_tokens(drafter) else ())
    missing = [name for name in called if not callable(getattr(drafter, name, None))]
    if missing:
        factory = (" (a callable: generate() takes a Drafter instance, SpeculativeDecoder(drafter=...) a callable "
                   "returning a new one per session)") if callable(drafter) else ""
        raise TypeError(f"drafter= takes a Drafter instance (generation/drafter.py); {type(drafter).__name__} has no "
                        f"{', '.join(missing)}{factory}")


class ModelDrafter:
    """A ``Drafter`` that runs a draft model one token at a time through its runner.

    bridge: maps the draft's vocabulary onto the target's (``vocab.py``); dtype: the verification's dtype (the
    target's); q's logits are kept in the wider of it and the draft's (a float32 draft of a float16 target keeps
    float32: cast down, logits past 65504 became inf; the ops verify mixed dtypes exactly, in float32). Each row's input not yet in the draft's cache is ``pending``: the last
    emitted token, after a fully accepted iteration also the last draft (fed together as a width-2 step, with a
    filler for the rows that need only one).
    """

    # its ids are in [0, V) by construction (drawn by the loop's choose / copied from the checked context), so
    # the loop checks only its proposal's shapes (``proposal.py``); read on the exact class: a subclass (which may
    # override propose) is checked as a user's drafter
    PROPOSES_VALID_IDS = True

    # The widths of the draft's forwards while drafting (pending 1 or 2 tokens), last position only: what
    # ``compile=True`` captures.
    CAPTURED_SHAPES = ((1, True), (2, True))

    def __init__(self, runner: Runner, bridge: VocabBridge, dtype: torch.dtype, keep_logits: bool = True,
                 prefill_chunk_size: int | None = None):
        self.runner, self.bridge, self.dtype = runner, bridge, dtype
        self.prefill_chunk_size = prefill_chunk_size  # HF's: the most prompt tokens of one prefill forward (None: all)
        # False when nothing reads q (a greedy request: greedy verification takes no q): propose returns no logits,
        # which saves a [B, V] copy per draft step and the [B, gamma, V] buffer
        self.keep_logits = keep_logits
        self.pending: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (tokens [B, P], real [B, P] or None)
        self._forwards = 0

    def start(self, input_ids: torch.Tensor, real: torch.Tensor) -> None:
        if input_ids.shape[1] > 1:
            prompt = prompt_real(real[:, :-1], bool(real.all()))
            prefill(self.runner, self.bridge.draft_inputs(input_ids[:, :-1]), prompt, self.prefill_chunk_size)
        self.pending = (input_ids[:, -1:], None)

    def propose(self, gamma: int, choose: ChooseToken) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        inputs, real = self.pending
        batch, device = inputs.shape[0], inputs.device
        tokens = torch.empty(batch, gamma, dtype=torch.int64, device=device)
        q_logits = None
        for i in range(gamma):  # per step: the forward, the choice, its two writes (and the runner's position)
            logits = self.runner.forward(self.bridge.draft_inputs(inputs), real, last_only=True)
            logits = self.bridge.draft_logits(logits)[:, 0]
            if logits.dtype != self.dtype:  # (the wider of the two: cast down, a float32 draft's logits can overflow)
                logits = logits.to(torch.promote_types(self.dtype, logits.dtype))
            token = choose(logits, i)
            if self.keep_logits:
                if q_logits is None:
                    q_logits = torch.empty(batch, gamma, logits.shape[-1], dtype=logits.dtype, device=device)
                q_logits[:, i] = logits
            tokens[:, i] = token
            inputs, real = tokens[:, i : i + 1], None  # (choose gives ids in [0, V): fed as they are)
        self._forwards += gamma
        return tokens, q_logits, None

    def observe(self, out: torch.Tensor, accepted: torch.Tensor | None, finished: torch.Tensor) -> None:
        """The draft catches up on the emitted tokens in ``accept`` (as pending inputs), except after an iteration
        with nothing drafted (accepted None: a first token taken from the prompts' forward, or a last one), which
        has no ``accept``: its token out [B, 1] joins the pending inputs here."""
        if accepted is None:
            tokens, real = self.pending
            column = out[:, :1]
            if tokens.shape[0] > 1:  # a row finished before emits nothing (-1): its column is a hole, not real (on
                # every iteration of a pause, gamma = 0, its positions would otherwise run past its end, and past a
                # learned position table the request was checked against; one row: the loop ends when it finishes)
                real = torch.cat([torch.ones_like(tokens, dtype=torch.bool) if real is None else real,
                                  ~finished.unsqueeze(1)], dim=1)
                column = column.clamp(min=0)
            elif real is not None:
                real = torch.cat([real, torch.ones_like(real[:, :1])], dim=1)
            self.pending = (torch.cat([tokens, column], dim=1), real)

    def proposal_counts(self) -> None:
        return None

    def accept(self, draft_tokens: torch.Tensor, accepted: torch.Tensor, accepted_host: list[int],
               next_token: torch.Tensor, finished: torch.Tensor) -> None:
        gamma = draft_tokens.shape[1]
        max_n = max(accepted_host)
        # The draft's cache holds the pending tokens and the first gamma - 1 drafts (the last was never fed).
        pending_width = self.pending[0].shape[1]
        width, max_kept = pending_width + gamma - 1, pending_width + min(max_n, gamma - 1)
        if len(accepted_host) == 1:  # one row: the loop rolls back only an unfinished one; kept is a host value
            kept_host = [max_kept]
            kept = host_to_device(kept_host, torch.int64, accepted.device)
            self.runner.keep_prefix(width, kept, max_kept, kept_host)
        else:
            kept = (pending_width + accepted.clamp(max=gamma - 1)).masked_fill(finished, 0)
            self.runner.keep_prefix(width, kept, max_kept)
        if max_n < gamma:
            self.pending = (next_token.unsqueeze(1), None)
            return
        if all(a == gamma for a in accepted_host):  # every row still has to feed its last draft
            self.pending = (torch.stack([draft_tokens[:, -1], next_token], dim=1), None)
            return
        all_in = accepted == gamma  # these rows still have to feed their last draft
        first = torch.where(all_in, draft_tokens[:, -1], torch.zeros_like(next_token))
        real = torch.stack([all_in, torch.ones_like(all_in)], dim=1)
        self.pending = (torch.stack([first, next_token], dim=1), real)

    def select_rows(self, index: torch.Tensor) -> None:
        self.runner.select_rows(index)
        tokens, real = self.pending
        self.pending = (tokens.index_select(0, index), None if real is None else real.index_select(0, index))

    def add_rows(self, other: "ModelDrafter") -> None:
        """Append ``other``'s rows: its runner's rows, and its pending inputs (when the two sides' pending widths
        differ, the narrower side gets a filler column on the left, marked not real)."""
        if not isinstance(other, ModelDrafter) or self.pending is None or other.pending is None:
            raise ValueError("add_rows needs another started ModelDrafter")
        pending = _joined_pending(self.pending, other.pending)
        self.runner.add_rows(other.runner)
        self.pending = pending
        self._forwards += other._forwards

    def lengths_to_read(self) -> torch.Tensor | None:
        return self.runner.lengths_to_read()

    def lengths_read(self, lengths: list[int]) -> None:
        self.runner.lengths_read(lengths)

    @property
    def forwards(self) -> int:
        return self._forwards

    @property
    def compactions(self) -> int:
        return self.runner.compactions


def _joined_pending(first, second):
    """Two ``ModelDrafter.pending`` pairs (tokens [B, P], real [B, P] bool or None) -> one over both sides' rows; a
    side with fewer pending tokens is padded on the left with filler tokens (0) that are not real."""
    width = max(first[0].shape[1], second[0].shape[1])
    if first[0].shape[1] == second[0].shape[1] and first[1] is None and second[1] is None:
        return torch.cat([first[0], second[0]]), None
    tokens, reals = [], []
    for side_tokens, side_real in (first, second):
        pad = width - side_tokens.shape[1]
        real = torch.ones_like(side_tokens, dtype=torch.bool) if side_real is None else side_real
        tokens.append(torch.nn.functional.pad(side_tokens, (pad, 0), value=0))
        reals.append(torch.nn.functional.pad(real, (pad, 0), value=False))
    return torch.cat(tokens), torch.cat(reals)
