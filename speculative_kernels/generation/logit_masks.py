"""The logits processors of HF's greedy/sampling generation besides warping, as in-place masks: EOS suppressed
before ``min_new_tokens`` (``MinLength``/``MinNewTokensLength``) and forced first/last tokens (``ForcedBOS``/
``ForcedEOS``). The loop applies them to the target's and the draft's logits alike, so q is what the draft sampled
from and p what HF would sample from."""

import torch

from .settings import Plan, token_ids


class LogitMasks:
    """plan: the request's; prompt_length: the (decoder) prompt's width; vocab: V. rows: per-row minimums and EOS
    ids (``RowSettings``: a batch of separate requests), which replace the plan's."""

    def __init__(self, plan: Plan, prompt_length: int, vocab: int, device: torch.device, rows=None):
        # (a minimum past max_new_tokens masks EOS to the end, as max_new_tokens does: held within int64, per row too)
        self.min_new_tokens = min(plan.min_new_tokens, plan.max_new_tokens) if plan.eos_token_ids else 0
        self.eos_columns = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]: True at EOS ids
        self.eos_columns[[e for e in plan.eos_token_ids if 0 <= e < vocab]] = True
        self.forced = self._forced_columns(plan, prompt_length, vocab, device)
        # Per row (None unless some row of a RowSettings batch has a minimum and EOS ids): min_new [B, 1] int64,
        # the row's EOS columns [B, 1, V] bool.
        self.row_min_new = self.row_eos_columns = None
        if rows is not None:
            self.min_new_tokens = 0
            minimums = [min(m, n) if eos else 0 for m, n, eos in zip(rows.min_new_tokens, rows.max_new_tokens,
                                                                      rows.eos)]
            if max(minimums, default=0) > 0:
                self.row_min_new = torch.tensor(minimums, dtype=torch.int64, device=device).unsqueeze(1)
                columns = torch.zeros(rows.batch, 1, vocab, dtype=torch.bool, device=device)
                for row, eos in enumerate(rows.eos):
                    columns[row, 0, [e for e in eos if 0 <= e < vocab]] = True
                self.row_eos_columns = columns

    @property
    def active(self) -> bool:
        return bool(self.forced) or self.min_new_tokens > 0 or self.row_min_new is not None

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the per-row masks of rows ``index`` [B'] (rows leaving the batch)."""
        if self.row_min_new is not None:
            self.row_min_new = self.row_min_new.index_select(0, index)
            self.row_eos_columns = self.row_eos_columns.index_select(0, index)

    def add_rows(self, other: "LogitMasks", batch: int, other_batch: int) -> None:
        """Append the per-row masks of ``other`` (``batch`` / ``other_batch``: each side's B) after these: rows
        joining the batch. Both sides must hold per-row settings only (no plan-wide minimum, no forced tokens)."""
        if self.forced or other.forced or self.min_new_tokens or other.min_new_tokens:
            raise ValueError("add_rows needs masks of per-row settings (no forced tokens, no plan-wide minimum)")
        if self.row_min_new is None and other.row_min_new is None:
            return
        vocab = (self.row_eos_columns if self.row_min_new is not None else other.row_eos_columns).shape[-1]
        sides, device = ((self, batch), (other, other_batch)), self.eos_columns.device
        min_new = torch.cat([m.row_min_new if m.row_min_new is not None else
                             torch.zeros(b, 1, dtype=torch.int64, device=device) for m, b in sides])
        columns = torch.cat([m.row_eos_columns if m.row_eos_columns is not None else
                             torch.zeros(b, 1, vocab, dtype=torch.bool, device=device) for m, b in sides])
        self.row_min_new, self.row_eos_columns = min_new, columns

    def apply(self, logits: torch.Tensor, generated_before: torch.Tensor) -> None:
        """In place on logits [B, T, V] whose positions follow generated_before [B, T] new tokens."""
        if self.min_new_tokens > 0:  # EOS gets -inf where fewer than min_new_tokens have been generated
            too_early = (generated_before < self.min_new_tokens).unsqueeze(-1)
            logits.masked_fill_(too_early & self.eos_columns, float("-inf"))
        if self.row_min_new is not None:  # the same, with each row's own minimum and EOS ids
            too_early = (generated_before < self.row_min_new).unsqueeze(-1)
            logits.masked_fill_(too_early & self.row_eos_columns, float("-inf"))
        for at, columns in self.forced:  # every logit -inf but the forced token's, which is 0 (as HF sets it)
            hit = (generated_before == at).unsqueeze(-1)
            logits.masked_fill_(hit & ~columns, float("-inf")).masked_fill_(hit & columns, 0.0)

    @staticmethod
    def _forced_columns(plan: Plan, prompt_length: int, vocab: int, device: torch.device) -> list:
        """(generated index, [V] bool columns kept) pairs: forced_bos at decoder length 1 (only when the prompt is a
        single token), forced_eos at max_length - 1."""
        config, forced = plan.generation_config, []
        # HF forces EOS where the length equals max_length - 1: never when a fractional max_new_tokens/max_length
        # (5.5: generation stops at 6 new tokens) makes max_length fractional.
        length = config.max_new_tokens if config.max_new_tokens is not None else config.max_length
        eos_at = plan.max_new_tokens - 1 if length is None or float(length).is_integer() else -1
        for name, value, at in (("forced_bos_token_id", config.forced_bos_token_id, 1 - prompt_length),
                                ("forced_eos_token_id", config.forced_eos_token_id, eos_at)):
            ids = list(token_ids(name, value))  # (an int, a list, a numpy integer, a tensor: as HF takes them)
            if not ids or not 0 <= at <= torch.iinfo(torch.int64).max:  # (past int64: a step never reached)
                continue
            if not all(0 <= i < vocab for i in ids):
                raise ValueError(f"forced token ids {ids} are outside the vocabulary (size {vocab})")
            columns = torch.zeros(vocab, dtype=torch.bool, device=device)
            columns[ids] = True
            forced.append((at, columns))
        return forced
