"""Universal assisted generation: a ``Drafter`` whose draft model has another tokenizer than the target (HF's
``model.generate(..., assistant_model=draft, tokenizer=tok, assistant_tokenizer=draft_tok)``).

The draft reads its own tokenization of the text so far and drafts gamma tokens greedily; their text becomes target
tokens, which are proposed without a distribution (q one-hot: ``ops.verify`` with ``draft_logits=None``). Each
iteration:

1. the loop's one host read of the emitted tokens is handed to the drafter (``emitted_read``; the drafter asks for it
   with ``READS_EMITTED_TOKENS``): each row's text grows and the draft's tokens of it are re-encoded from a lookbehind
   mark (``retokenize.RowText``);
2. ``propose``: the draft's cache keeps the common prefix of what it holds and its new tokens (``DraftSlots``), the
   changed tail is fed in one forward (rows left-padded with holes), then gamma - 1 one-token steps; the gamma draft
   tokens are read to the host (the drafter's own read: their text is needed to make target tokens, as in HF) and
   turned into each row's proposal, num_draft[b] <= gamma tokens (0 where nothing maps).

Exactness, greedy: the verification emits the target's argmax whatever is proposed. Sampling: a proposal x drawn
independently of the verification's random numbers (here a deterministic function of the emitted tokens) is
accepted with probability p(x) and, on rejection, the token is drawn from the residual p restricted to v != x,
renormalised: P(emit v) = [v = x] p(x) + (1 - p(x)) p(v) [v != x] / (1 - p(x)) = p(v) for every x (p(x) = 1: always
accepted, P = p), so each position is distributed as p given the tokens before it, and so is the sequence.

The re-tokenization is host work per row and iteration (tokenizer calls over a window of about
``target_lookbehind`` + ``assistant_lookbehind`` tokens and the new ones, as in HF), and the draft tokens cost a
second device-to-host read per iteration beside the loop's. Rows leaving the batch read their index once
(``select_rows``); rows join a running batch (``SpeculativeDecoder.add_request``) with ``add_rows``. Not supported
(refused by name in ``request.py``, ``decoder.py``): the static cache, ``compile=True``, encoder-decoder models.
"""

import torch

from .drafter import ChooseToken
from .retokenize import RowText, TokenizerPair, common_prefix
from .runners import Runner
from .runners.prefill import prefill
from .transfer import host_to_device
from .vocab import embeddable_ids


class DraftSlots:
    """The draft runner's slots on the host: per row, the draft ids it holds (``fed``) and whether each slot is real
    (``layout``, ``runner.num_slots`` long), so that a row can drop its last tokens whatever the holes between them
    (``keep_prefix`` addresses slots). After a hole compaction (``runner.compactions`` grew) each row's real slots are
    its first ones."""

    def __init__(self, runner: Runner, batch: int, device: torch.device, chunk_size: int | None,
                 embeddable: int | None = None):
        self.runner, self.device, self.chunk_size = runner, device, chunk_size  # (chunk_size: of the prompt's prefill)
        # the ids the draft's input embedding takes (None: any): an assistant_tokenizer may hold more, which the
        # draft is fed as id 0 (only acceptance depends on what the draft conditions on, as in ``vocab.py``)
        self.embeddable = embeddable
        self.fed: list[list[int]] = [[] for _ in range(batch)]
        self.layout: list[list[bool]] = [[] for _ in range(batch)]
        self._compactions = runner.compactions

    def forward(self, tokens: list[list[int]], last_only: bool = True, prompt: bool = False) -> torch.Tensor:
        """Feed each row's tokens (host lists, rows left-padded with holes to the longest). Returns the last
        position's logits [B, 1, V_d]."""
        width = max(len(t) for t in tokens)
        pads = [width - len(t) for t in tokens]
        limit = self.embeddable
        ids = [[0] * p + (t if limit is None else [k if k < limit else 0 for k in t]) for p, t in zip(pads, tokens)]
        device = self.device
        real = None
        if any(pads):
            real = host_to_device([[k >= p for k in range(width)] for p in pads], torch.bool, device)
        if prompt:
            logits = prefill(self.runner, host_to_device(ids, torch.int64, device), real, self.chunk_size)
        else:
            logits = self.runner.forward(host_to_device(ids, torch.int64, device), real, last_only=last_only)
        self.appended(tokens, pads)
        return logits

    def appended(self, tokens: list[list[int]], pads: list[int]) -> None:
        for fed, layout, t, p in zip(self.fed, self.layout, tokens, pads):
            fed.extend(t)
            layout.extend([False] * p + [True] * len(t))

    def keep(self, counts: list[int]) -> None:
        """Row b keeps its first counts[b] fed tokens (<= what it holds)."""
        slots = self.runner.num_slots
        cuts = []
        for fed, layout, n in zip(self.fed, self.layout, counts):
            drop, cut = len(fed) - n, slots
            while drop > 0:  # (walk back over the row's last slots: holes and the real ones it drops)
                cut -= 1
                drop -= layout[cut]
            cuts.append(cut)
        start = min(cuts)
        if start == slots:
            return
        kept = [c - start for c in cuts]
        self.runner.keep_prefix(slots - start, host_to_device(kept, torch.int64, self.device), max(kept),
                                kept)
        slots = self.runner.num_slots
        for fed, layout, n, cut in zip(self.fed, self.layout, counts, cuts):
            del fed[n:]
            del layout[min(cut, slots):]
            layout.extend([False] * (slots - len(layout)))
        if self.runner.compactions != self._compactions:  # squeezed: every row's real slots first
            self._compactions = self.runner.compactions
            self.layout = [[k < len(fed) for k in range(slots)] for fed in self.fed]

    def select(self, rows: list[int]) -> None:
        self.fed = [self.fed[b] for b in rows]
        self.layout = [self.layout[b] for b in rows]

    def joined(self, other: "DraftSlots", pad: int, other_pad: int) -> None:
        """``other``'s rows appended after the runners' ``add_rows``: each side's slots behind ``pad`` /
        ``other_pad`` holes on the left."""
        self.layout = ([[False] * pad + layout for layout in self.layout]
                       + [[False] * other_pad + layout for layout in other.layout])
        self.fed += other.fed
        self._compactions = self.runner.compactions


class RetokenizingDrafter:
    """A ``Drafter`` for a draft model with its own tokenizer. runner: the draft model's (dynamic cache); pair: the
    two tokenizers and the lookbehinds; prefill_chunk_size: HF's, for the draft's prompt. One object serves one call."""

    READS_EMITTED_TOKENS = True  # the loop calls emitted_read with its host copy of the iteration's tokens

    def __init__(self, runner: Runner, pair: TokenizerPair, device: torch.device,
                 prefill_chunk_size: int | None = None, position_limit: int | None = None,
                 embeddable: int | None = None, slot_limit: int | None = None):
        self.runner, self.pair, self.device = runner, pair, device
        # the most key slots a forward of the draft can take (``capabilities.slot_table_limit``: GPT-Neo, MPT), or
        # None: an iteration whose draft forwards would pass it drafts nothing (the holes of left padding and of
        # dropped tokens take slots past the rows' positions)
        self.slot_limit = slot_limit
        # the ids the draft's input embedding takes (``vocab.vocabulary_size``), or None (any): draft ids past it
        # (an assistant_tokenizer with more ids than the draft model) are fed as id 0 (``DraftSlots``, ``_fed_ids``)
        self.embeddable = embeddable
        self.prefill_chunk_size = prefill_chunk_size
        # the draft's learned position table (``capabilities.position_table_limit``), or None: a row whose draft
        # tokens would pass it drafts no more (the target goes on alone for it)
        self.position_limit = position_limit
        self.rows: list[RowText] = []
        self.finished: list[int] = []
        self.slots: DraftSlots | None = None
        self._forwards = 0

    def start(self, input_ids: torch.Tensor, real: torch.Tensor) -> None:
        """Decode each row's real prompt tokens (one host read of the prompts, before decoding starts) and prefill
        the draft with its tokens of that text but the last."""
        ids, mask = input_ids.tolist(), real.tolist()
        self.rows = [RowText(self.pair, [t for t, r in zip(row, m) if r]) for row, m in zip(ids, mask)]
        longest = max(len(row.draft_ids) for row in self.rows)
        if self.position_limit is not None and longest > self.position_limit:
            raise ValueError(f"draft_model has a learned position table of {self.position_limit} positions, and a "
                             f"prompt's text is {longest} of its tokens (assistant_tokenizer's): shorten the prompt, "
                             "or use a draft with a longer context")
        self.finished = [0] * len(self.rows)
        self.slots = DraftSlots(self.runner, len(self.rows), self.device, self.prefill_chunk_size, self.embeddable)
        prompts = [row.draft_ids[:-1] for row in self.rows]
        if any(prompts):
            self.slots.forward(prompts, prompt=True)

    def propose(self, gamma: int, choose: ChooseToken) -> tuple[torch.Tensor, None, torch.Tensor]:
        """gamma greedy draft steps from each row's draft tokens; returns the target tokens [B, gamma] (fillers 0
        past num_draft), None (no q) and num_draft [B]."""
        tails, active = self._sync(gamma)
        proposals = [[] for _ in active]
        if any(active):
            logits = self.slots.forward(tails)
            drafts = [logits[:, -1].argmax(dim=-1)]
            real = self._steps_real(active)
            for _ in range(gamma - 1):
                fed = self._fed_ids(drafts[-1].unsqueeze(1), logits.shape[-1])
                logits = self.runner.forward(fed, real, last_only=True)
                drafts.append(logits[:, -1].argmax(dim=-1))
            self._forwards += gamma
            drafted = torch.stack(drafts, dim=1).tolist()  # the drafter's own read: [B, gamma] draft ids
            self._fed_steps([d[:-1] for d in drafted], active)
            proposals = [row.proposal(d, gamma) if a else [] for row, d, a in zip(self.rows, drafted, active)]
        tokens = host_to_device([p + [0] * (gamma - len(p)) for p in proposals], torch.int64, self.device)
        return tokens, None, host_to_device([len(p) for p in proposals], torch.int64, self.device)

    def _sync(self, gamma: int) -> tuple[list[list[int]], list[bool]]:
        """Roll the draft's cache back to the common prefix of what it holds and each row's draft tokens (keeping
        the last token out, to feed it). Returns each row's tokens to feed and whether it drafts: a finished row,
        and one whose gamma drafts would pass the draft's position table, feed holes and draft nothing; no row drafts
        where the forwards would pass the draft's slot table (``slot_limit``)."""
        keep, tails, active = [], [], []
        for row, fed, f in zip(self.rows, self.slots.fed, self.finished):
            target = row.draft_ids
            if f or (self.position_limit is not None and len(target) + gamma - 1 > self.position_limit):
                keep.append(len(fed))
                tails.append([])
                active.append(False)
                continue
            start = min(row.take_unchanged(), len(fed))  # (fed[:start] == target[:start] since the last sync)
            n = min(start + common_prefix(fed[start:], target[start:]), len(target) - 1)
            keep.append(n)
            tails.append(target[n:])
            active.append(True)
        self.slots.keep(keep)
        if self.slot_limit is not None and any(active):  # (the tail's forward, then gamma - 1 one-token steps)
            if self.runner.num_slots + max(len(t) for t in tails) + gamma - 1 > self.slot_limit:
                return [[] for _ in tails], [False] * len(tails)
        return tails, active

    def _fed_ids(self, ids: torch.Tensor, width: int) -> torch.Tensor:
        """Draft ids [B, n] below ``width`` (the draft's logit width) as fed to the draft: id 0 for those past its
        input embedding (a head wider than its embedding only; one device op then)."""
        if self.embeddable is None or width <= self.embeddable:
            return ids
        return embeddable_ids(ids, self.embeddable)

    def _steps_real(self, active: list[bool]) -> torch.Tensor | None:
        """real [B, 1] of the one-token draft steps: False for the rows that draft nothing (None: every row drafts)."""
        return None if all(active) else host_to_device([[a] for a in active], torch.bool, self.device)

    def _fed_steps(self, fed: list[list[int]], active: list[bool]) -> None:
        """The draft ids the one-token steps fed (host; gamma - 1 per row): holes for the rows that draft nothing."""
        width = max(len(f) for f in fed)
        self.slots.appended([f if a else [] for f, a in zip(fed, active)], [0 if a else width for a in active])

    def observe(self, out: torch.Tensor, accepted: torch.Tensor | None, finished: torch.Tensor) -> None:
        """Nothing on the device: the emitted tokens arrive on the host (``emitted_read``)."""

    def emitted_read(self, emitted: list[list[int]], finished: list[int]) -> None:
        """After the loop's host read: each row's emitted tokens (host ints, after its EOS and length cuts) and the
        finished flags. The text grows here; the draft catches up in the next ``propose``."""
        for row, tokens, f in zip(self.rows, emitted, finished):
            if not f:
                row.extend(tokens)
        self.finished = list(finished)

    def accept(self, draft_tokens, accepted, accepted_host, next_token, finished) -> None:
        """Nothing to roll back here: ``propose`` re-synchronises the draft's cache with the text."""

    def proposal_counts(self) -> None:
        return None

    def select_rows(self, index: torch.Tensor) -> None:
        rows = index.tolist()  # (rows leave between iterations, rarely: one read of their index)
        self.runner.select_rows(index)
        self.rows = [self.rows[b] for b in rows]
        self.finished = [self.finished[b] for b in rows]
        self.slots.select(rows)

    def add_rows(self, other: "RetokenizingDrafter") -> None:
        """Append ``other``'s rows (a drafter of the same kind over the same draft model, started on them: requests
        joining a running batch). The runners' rows join with holes on the left of the side with fewer slots, and
        each row's slot layout follows; each row keeps its own text and tokenizer settings."""
        if type(other) is not type(self) or self.slots is None or other.slots is None:
            raise ValueError(f"add_rows needs another started {type(self).__name__}")
        slots = max(self.runner.num_slots, other.runner.num_slots)
        pads = slots - self.runner.num_slots, slots - other.runner.num_slots
        self.runner.add_rows(other.runner)  # (raises with nothing changed where the rows cannot join)
        self.slots.joined(other.slots, *pads)
        self.rows += other.rows
        self.finished += other.finished
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


class VocabularyMap:
    """Ids of one token in both vocabularies (HF's ``AssistantToTargetTranslator``: the same token string, the
    draft's word-initial space sign written as the target's). to_target: [V_d] int64, the target id of each draft
    id or -1; to_draft: [V_t] int64, the draft id of each target id or -1 (V_d, V_t: the models' logit widths).
    Built on the host once per call (one pass over both vocabularies)."""

    def __init__(self, tokenizer, assistant_tokenizer, target_width: int, draft_width: int, device: torch.device):
        target_vocab = tokenizer.get_vocab()
        draft_vocab = assistant_tokenizer.get_vocab()
        sign, draft_sign = _space_sign(tokenizer), _space_sign(assistant_tokenizer)
        to_target, to_draft = [-1] * draft_width, [-1] * target_width
        for token, d in draft_vocab.items():
            if draft_sign and sign and draft_sign != sign and token.startswith(draft_sign):
                token = sign + token[len(draft_sign):]
            t = target_vocab.get(token)
            if t is not None and d < draft_width and t < target_width:
                to_target[d], to_draft[t] = t, d
        self.to_target = host_to_device(to_target, torch.int64, device)
        self.to_draft = host_to_device(to_draft, torch.int64, device)
        self.shared_draft_ids = torch.nonzero(self.to_target >= 0).squeeze(1)  # (at construction, not per iteration)
        self.shared_target_ids = self.to_target[self.shared_draft_ids]
        self.size = int(self.shared_draft_ids.numel())

    def target_logits(self, logits: torch.Tensor, width: int) -> torch.Tensor:
        """Draft logits [B, V_d] -> [B, width] over the target's ids: -inf where no draft token maps (q = 0)."""
        out = logits.new_full((logits.shape[0], width), float("-inf"))
        out[:, self.shared_target_ids] = logits[:, self.shared_draft_ids]
        return out

    def draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids -> the draft's (an id with none, only an invalid row's filler: 0)."""
        return self.to_draft[tokens].clamp(min=0)


def _space_sign(tokenizer) -> str:
    """The character a tokenizer writes for a word-initial space in its tokens (GPT-2's "Ġ", SentencePiece's "▁", a
    plain " "), or "" (none: a tokenizer that splits at spaces): what its normalizer and pre-tokenizer make of
    " x", else (a tokenizer without a ``backend_tokenizer``) the first character of its token for " ", as HF reads it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = " x" if backend.normalizer is None else backend.normalizer.normalize_str(" x")
        if backend.pre_tokenizer is not None:
            pieces = backend.pre_tokenizer.pre_tokenize_str(text)
            text = pieces[-1][0] if pieces else ""
        return text[-2] if len(text) >= 2 and text.endswith("x") else ""
    ids = tokenizer(" ", add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids[:1]) if ids else []
    return tokens[0][:1] if tokens and tokens[0] else ""


class MappedVocabularyDrafter(RetokenizingDrafter):
    """HF's universal speculative decoding (USD; its choice with ``do_sample=True``): the draft's logits restricted
    to the tokens both vocabularies have (``VocabularyMap``) are q over the target's ids, each draft token is drawn
    from them through the loop's ``choose`` and verified with that q (the paper's min(1, p/q) rule: exact), and is
    fed back to the draft as its own id. No read of its own: the draft ids it fed ride along the loop's one read
    (``lengths_to_read``), and the emitted tokens re-synchronise the draft's text as in ``RetokenizingDrafter``.
    target_width: the target's logit width V; keep_logits: False for a greedy request (no q needed)."""

    PROPOSES_VALID_IDS = True  # drawn by the loop's choose: ids in [0, V)

    def __init__(self, runner: Runner, pair: TokenizerPair, vocabulary: VocabularyMap, target_width: int,
                 dtype: torch.dtype, device: torch.device, keep_logits: bool = True,
                 prefill_chunk_size: int | None = None, position_limit: int | None = None,
                 embeddable: int | None = None, slot_limit: int | None = None):
        super().__init__(runner, pair, device, prefill_chunk_size, position_limit, embeddable, slot_limit)
        self.vocabulary, self.width, self.dtype, self.keep_logits = vocabulary, target_width, dtype, keep_logits
        self._fed: torch.Tensor | None = None  # [B, gamma - 1] draft ids fed while drafting, read with the loop's
        self._runner_reads = False  # the last lengths_to_read() began with the runner's lengths
        self._active: list[bool] = []  # the rows the last propose drafted for

    def propose(self, gamma: int, choose: ChooseToken) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                 torch.Tensor | None]:
        """gamma drafts per row drawn from q; num_draft: None, or 0 for the rows that draft nothing (finished, or
        at the draft's position table) and gamma for the others."""
        tails, active = self._sync(gamma)
        batch = len(active)
        tokens = torch.zeros(batch, gamma, dtype=torch.int64, device=self.device)
        if not any(active):
            return tokens, None, torch.zeros(batch, dtype=torch.int64, device=self.device)
        logits = self.slots.forward(tails)[:, -1]
        real = self._steps_real(active)
        self._active = active
        q = None
        for i in range(gamma):
            mapped = self.vocabulary.target_logits(logits.to(torch.promote_types(self.dtype, logits.dtype)),
                                                   self.width)
            tokens[:, i] = choose(mapped, i)
            if self.keep_logits:
                if q is None:
                    q = torch.empty(batch, gamma, self.width, dtype=mapped.dtype, device=self.device)
                q[:, i] = mapped
            if i < gamma - 1:
                fed = self._fed_ids(self.vocabulary.draft_ids(tokens[:, i : i + 1]), logits.shape[-1])
                logits = self.runner.forward(fed, real, last_only=True)[:, -1]
        self._forwards += gamma
        self._fed = self.vocabulary.draft_ids(tokens[:, :-1])
        num_draft = None if real is None else host_to_device([gamma * a for a in active], torch.int64, self.device)
        return tokens, q, num_draft

    def lengths_to_read(self) -> torch.Tensor | None:
        runner = self.runner.lengths_to_read()
        self._runner_reads = runner is not None
        parts = [p for p in (runner, None if self._fed is None else self._fed.flatten()) if p is not None]
        return torch.cat(parts) if parts else None

    def lengths_read(self, lengths: list[int]) -> None:
        """The runner's lengths, then the draft ids fed while drafting ([B, gamma - 1], row by row)."""
        if self._runner_reads:
            self.runner.lengths_read(lengths[: len(self.rows)])
            lengths = lengths[len(self.rows):]
        if self._fed is not None:
            width = self._fed.shape[1]
            self._fed_steps([lengths[b * width : (b + 1) * width] for b in range(len(self.rows))], self._active)
            self._fed = None
