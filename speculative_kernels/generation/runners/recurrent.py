"""``RecurrentRunner``: a model with conv / SSM / linear-attention states (Mamba2, Falcon-H1, Bamba, Granite 4
hybrids, Nemotron-H, Zamba2, Qwen3-Next, LFM2; ``capabilities.STATE_SNAPSHOT_EXACT``) at batch 1 on HF's dynamic
cache.

A recurrent state folds in every token, so a rejected draft cannot be cut off it as a slot is cut off a KV cache.
Before every forward after the prompt, the runner copies the states (``[B, ...]`` per layer: small, they do not grow
with the sequence) and remembers the tokens it feeds (a mark). A rollback to slot s restores the latest mark at or
before s and cuts the attention layers' K/V back to that mark; the tokens from the mark to s become pending, fed
first by the next forward (whose logits for them are not computed, ``logits_to_keep``), or re-run at once where
they are more than gamma + 1 (a chain of partly rejected iterations). The target marks before each verification, so
a partly rejected iteration's [last, d_1..d_n] ride along the next verification (on a GPU at batch 1 a wider forward
costs about the same); a draft marks before each of its one-token steps, so its rollback is a restore alone.
The re-run is exact because these models' forward over several tokens continues the cached state
(``capabilities``: Mamba's does not, it is refused). Where Mamba2 mixers bound the step size dt
(``spec.bounded_step_size``: Zamba2, Nemotron-H), every forward but the prompt's runs with the bound lifted, as
model.generate's one-token steps run (``step_size.py``).

Batch 1 only, without left padding (``capabilities.check_model``, ``request.build_loop``): the rollback reads the
kept count from the loop's host read (``kept_host``) and adds none of its own.
"""

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..capabilities import ModelSpec
from ..step_size import bounded_mixers, unbounded_step_size
from .slot_mask import accepts


def state_tensors(cache) -> list[torch.Tensor]:
    """Every conv and recurrent state tensor of ``cache``'s linear-attention layers ([B, ...] each; HF updates them
    in place), in a fixed order."""
    states = []
    for layer in [] if cache is None else cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for kind in (layer.conv_states, layer.recurrent_states):
                states += [kind[i] for i in sorted(kind) if kind[i] is not None]
    return states


def crop_attention(cache, num_slots: int) -> None:
    """Keep the first ``num_slots`` slots of every attention layer's K/V [B, H, S, D] (views); state layers keep
    their states."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4:
            layer.keys, layer.values = layer.keys[:, :, :num_slots], layer.values[:, :, :num_slots]


class RecurrentRunner:
    """A ``Runner`` for one model with recurrent states, batch 1, on HF's dynamic cache (see the module docstring).

    marks: (slot, state copies or None where no forward had made the cache yet) before each forward since the last
    rollback, at most ``reserve`` + 1 (the longest rollback, a draft's, spans one forward per draft step: gamma + 1
    slots at most); fed: (slot, tokens [1, T]) of those forwards, for the re-run. pending: [1, P] tokens a rollback
    kept but the state has not taken yet (the state is at slot num_slots - P): the next forward feeds them first
    (a re-run folded into it), unless they are more than ``defer`` (then they are re-run at once).
    """

    def __init__(self, model, spec: ModelSpec, device: torch.device, reserve: int, defer: int | None = None):
        self.model, self.spec, self.device = model, spec, device
        self.max_marks = reserve + 1
        self.defer = reserve if defer is None else defer
        self._flags = dict(spec.forward_flags)
        self._positions = accepts(model, "position_ids")
        self._logits_to_keep = accepts(model, "logits_to_keep")
        # (the mixers whose dt bound the forwards after the prompt lift: none where the spec says nothing is bounded)
        self._bounded = bounded_mixers(model) if spec.bounded_step_size else []
        self.cache = None
        self.num_slots = 0
        self.pending: torch.Tensor | None = None
        self.marks: list[tuple[int, list[torch.Tensor] | None]] = []
        self.fed: list[tuple[int, torch.Tensor]] = []
        self.restores = 0  # rollbacks that restored a mark (statistics, tests)
        self.reruns = 0  # ... and of them, those that re-ran the kept tokens in a forward of their own
        self.forwards = 0

    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None, last_only: bool = False,
                prompt: bool = False) -> torch.Tensor:
        """Run tokens [1, T] at the next T slots (real must be None: every token real), after the pending ones.
        Returns logits [1, T, V], or [1, 1, V] with last_only. A forward that is not the prompt's is marked first."""
        if real is not None:
            raise ValueError(f"{type(self.model).__name__} keeps a recurrent state, which every fed token reaches: "
                             "it runs on prompts without masked tokens only (attention_mask all ones)")
        width = tokens.shape[1]
        if self.pending is not None:
            tokens, self.pending = torch.cat([self.pending, tokens], dim=1), None
        start = self.num_slots + width - tokens.shape[1]  # (the state's slot)
        if not prompt:
            self._mark(start, tokens)
        logits = self._run(start, tokens, 1 if last_only else width, prompt)
        self.num_slots = start + tokens.shape[1]
        return logits

    def _mark(self, start: int, tokens: torch.Tensor) -> None:
        states = None if self.cache is None else [t.clone() for t in state_tensors(self.cache)]
        self.marks.append((start, states))
        self.fed.append((start, tokens.clone()))  # (a view of a buffer the caller may refill)
        if len(self.marks) > self.max_marks:  # (a target pausing at gamma 0 is never rolled back: keep the latest)
            del self.marks[0], self.fed[0]

    def _run(self, start: int, tokens: torch.Tensor, keep: int, prompt: bool = False) -> torch.Tensor:
        """The model over tokens [1, T] from the state at slot ``start``; the last ``keep`` positions' logits. A
        forward that is not the prompt's runs with the mixers' dt bound lifted (``step_size.py``)."""
        width = tokens.shape[1]
        kwargs = {"logits_to_keep": keep} if keep < width and self._logits_to_keep else {}
        if self._positions:
            kwargs["position_ids"] = torch.arange(start, start + width, device=tokens.device).unsqueeze(0)
        cache = self.cache if self.cache is not None else DynamicCache(config=self.model.config)
        with unbounded_step_size([] if prompt else self._bounded):
            out = self.model(input_ids=tokens, use_cache=True, return_dict=True, **{self.spec.cache_argument: cache},
                             **kwargs, **self._flags)
        self.cache = getattr(out, self.spec.cache_argument)
        self.forwards += 1
        return out.logits[:, -keep:]

    def keep_prefix(self, width: int, kept: torch.Tensor, max_kept: int, kept_host: list[int] | None = None) -> None:
        """Of the last ``width`` slots keep the first kept_host[0]: restore the latest mark at or before that slot;
        the tokens from it to the kept slot become pending (or are re-run now, past ``defer``). kept_host is
        required (batch 1: the loop and the draft pass it)."""
        if kept_host is None or len(kept_host) != 1:
            raise ValueError("RecurrentRunner rolls back one row, from the host's kept count (kept_host)")
        target = self.num_slots - width + kept_host[0]
        if target < self.num_slots:
            self._restore(target)
        self.marks.clear()
        self.fed.clear()

    def _restore(self, target: int) -> None:
        index = max((i for i, (slot, _) in enumerate(self.marks) if slot <= target), default=None)
        if index is None:
            raise RuntimeError(f"cannot roll back to slot {target}: no mark at or before it (marks at "
                               f"{[slot for slot, _ in self.marks]})")
        slot, states = self.marks[index]
        kept = torch.cat([tokens for _, tokens in self.fed[index:]], dim=1)[:, : target - slot]
        if states is None:  # the mark came before the first forward: start over from an empty cache
            self.cache = None
        else:
            current = state_tensors(self.cache)
            if len(current) != len(states):  # (every state is made by the prompt's forward, before any mark)
                raise RuntimeError(f"{type(self.model).__name__}'s cache holds {len(current)} state tensors, its mark "
                                   f"{len(states)}: a state layer was initialised after the prompt")
            for state, saved in zip(current, states):
                state.copy_(saved)
            crop_attention(self.cache, slot)
        self.num_slots, self.pending = target, None
        self.restores += 1
        if target - slot > self.defer:
            self.reruns += 1
            self._run(slot, kept, 1)
        elif target > slot:
            self.pending = kept

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] of the states and K/V (batch 1: the row, or none once it finished)."""
        if self.cache is not None:
            for layer in self.cache.layers:
                if isinstance(layer, LinearAttentionCacheLayerMixin):
                    for kind in (layer.conv_states, layer.recurrent_states):
                        for i in kind:
                            if kind[i] is not None:
                                kind[i] = kind[i].index_select(0, index)
                keys = getattr(layer, "keys", None)
                if keys is not None and keys.dim() == 4:
                    layer.keys, layer.values = keys.index_select(0, index), layer.values.index_select(0, index)
        if self.pending is not None:
            self.pending = self.pending.index_select(0, index)
        self.marks.clear()
        self.fed.clear()

    def check_add_rows(self, other) -> None:
        raise NotImplementedError("a model with recurrent states runs at batch 1: no rows join it")

    def add_rows(self, other) -> None:
        self.check_add_rows(other)

    def lengths_to_read(self) -> None:
        return None

    def lengths_read(self, lengths: list[int]) -> None:
        pass

    @property
    def compactions(self) -> int:
        return 0
