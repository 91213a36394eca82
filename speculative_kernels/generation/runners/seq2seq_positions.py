"""``DecoderPositions``: the hooks that give an encoder-decoder's decoder each row's true positions during one of a
runner's forwards, for the decoders that derive positions from the cache (``capabilities.POSITION_KINDS``).

HF numbers a forward's tokens from the cache's length, one offset for the batch; the runners' rows sit at their own
lengths (right-aligned in the dynamic cache, left-aligned with a pointer each in the static one). Per kind:
"absolute" (BART, Marian, Pegasus, ...; a generic wrapper's learned-TrOCR or BART-family decoder): the position
table read at the true positions; "absolute_skipping_pads" (M2M100/NLLB; a wrapper's sinusoidal TrOCR): its sinusoids
numbered from the token ids as its one-token steps number them; "absolute_fsmt" (FSMT): its table read where
model.generate's steps read it; "computed" (Pegasus-X): its sinusoids recomputed by its own module. "relative",
"position_ids" and "position_ids_skipping_pads" need no hook here (T5's bias is the static runner's; T5Gemma's and a
wrapper's BERT-, GPT-2- or RoBERTa-like decoder take ids: the runner's ``_position_ids``).
"""

import inspect
import threading
from collections.abc import Callable

import torch

from ..wrapped_seq2seq import is_wrapper, position_module

# The keyword by which a position table's forward takes the cache's length: transformers 5.24 names it cache_length,
# 5.18-5.23 past_key_values_length (FSMT's, TrOCR's; FSMT's took neither in 5.17, whose steps did not count).
CACHE_LENGTH_ARGUMENTS = ("cache_length", "past_key_values_length")


def takes_cache_length(forward) -> bool:
    """Whether ``forward`` (a position table's) takes the cache's length, under either of its names."""
    return not set(CACHE_LENGTH_ARGUMENTS).isdisjoint(inspect.signature(forward).parameters)


class DecoderPositions:
    """The position hooks of one model's decoder. kind: its ``POSITION_KINDS`` value; positions: returns the true
    positions [B, T] of the forward running now (read while the hooks run: a captured step sets them inside)."""

    def __init__(self, model, kind: str, positions: Callable[[], torch.Tensor]):
        self.kind, self._positions = kind, positions
        self.module = None
        if kind in ("absolute", "absolute_skipping_pads", "absolute_fsmt", "computed"):
            # (a generic wrapper's: its decoder's table, ``wrapped_seq2seq.position_module``: TrOCR's, BART's, ...)
            self.module = position_module(model) if is_wrapper(model) else model.get_decoder().embed_positions
        if kind in ("absolute", "absolute_skipping_pads"):
            table = torch.nn.Embedding if kind == "absolute" else torch.nn.Module
            if not isinstance(self.module, table) or (kind == "absolute_skipping_pads" and not all(
                    hasattr(self.module, a) for a in ("weights", "padding_idx"))):
                raise ValueError(f"{type(model).__name__}: unexpected decoder position embedding type")
        # (FSMT: whether its steps number positions, transformers >= 5.18, where its table takes the cache length;
        #  reading only 5.24's name, cache_length, numbered 5.18-5.23's steps as 5.17's: other tokens, silently)
        self.fsmt_counts_steps = kind == "absolute_fsmt" and takes_cache_length(self.module.forward)
        self._thread = None

    def register(self) -> list:
        """The hooks for one forward of the calling thread (handles to remove after it)."""
        self._thread = threading.get_ident()
        module = self.module
        if module is None:
            return []
        if self.kind == "computed":
            return [module.register_forward_hook(self._computed_positions, with_kwargs=True, prepend=True)]
        if self.kind == "absolute_fsmt":
            return [module.register_forward_pre_hook(self._from_zero, with_kwargs=True, prepend=True),
                    module.register_forward_hook(self._fsmt_step_positions, with_kwargs=True, prepend=True)]
        if self.kind == "absolute_skipping_pads":
            return [module.register_forward_pre_hook(self._from_zero, with_kwargs=True, prepend=True),
                    module.register_forward_hook(self._true_positions_skipping_pads, with_kwargs=True,
                                                 prepend=True)]
        # (first of the module's hooks: a caller's own hooks see, and may change, the true positions' output, as
        #  they see HF's)
        return [module.register_forward_pre_hook(self._inside_table, with_kwargs=True, prepend=True),
                module.register_forward_hook(self._true_positions, prepend=True)]

    def own_forward(self) -> bool:
        """Whether a hook runs in the runner's own forward. The hooks sit on the model's shared submodules while
        it runs, where another thread's forward of the same model (its ``model.generate``, or another call's
        runner), which HF allows, runs them too: they leave such forwards alone. (While dynamo traces a captured
        step, the forward is the runner's: its thread is not read there.)"""
        return torch.compiler.is_compiling() or threading.get_ident() == self._thread

    def cover(self, positions: int) -> None:
        """Grow M2M100's and FSMT's sinusoid tables (as their forwards do, by their own ``make_weights`` /
        ``make_weight``) to hold ``positions`` (a host bound on the rows' next position plus the forward's width)
        past the pad id: the hooks read them at each row's true positions, which HF's own growth check, given
        position 0, does not see."""
        module = self.module
        if self.kind == "absolute_fsmt":  # (FSMT's num_embeddings stays as built: its weight's length is read)
            needed = module.padding_idx + 2 + positions
            if self.fsmt_counts_steps and needed > module.weight.shape[0]:
                module.make_weight(needed, module.embedding_dim, module.padding_idx)
        elif self.kind == "absolute_skipping_pads":
            needed = module.padding_idx + 2 + positions
            if needed > module.weights.shape[0] and hasattr(module, "make_weights"):  # (TrOCR's never grow)
                module.make_weights(needed + module.offset, module.embedding_dim, module.padding_idx)

    def _inside_table(self, module, args, kwargs):
        """Forward pre-hook: HF's own lookup, whose output ``_true_positions`` replaces, reads the table from the
        cache's width, which a batch's rows (right-aligned in a cache wider than the longest by up to a few
        verification blocks) may place past the table's end (an IndexError where every true position fits): it
        starts from 0 instead, and position ids given to it are clamped into the table."""
        if not self.own_forward():
            return None
        limit = module.num_embeddings - getattr(module, "offset", 0) - 1
        args = tuple(0 if i == 1 else a.clamp(max=limit) if i == 2 and torch.is_tensor(a) else a
                     for i, a in enumerate(args))
        kwargs = {k: 0 if k in CACHE_LENGTH_ARGUMENTS
                  else v.clamp(max=limit) if k == "position_ids" and torch.is_tensor(v) else v
                  for k, v in kwargs.items()}
        return args, kwargs

    def _true_positions(self, module, args, output):
        """Forward hook: the position embeddings of each row's true positions [B, T] (HF reads the cache width)."""
        if not self.own_forward():
            return None
        limit = module.num_embeddings - getattr(module, "offset", 0) - 1
        positions = self._positions().clamp(max=limit) + getattr(module, "offset", 0)  # fillers may run past the end
        return torch.nn.functional.embedding(positions, module.weight).to(output.dtype)

    def _from_zero(self, module, args, kwargs):
        """Forward pre-hook (M2M100, FSMT): HF's own lookup, which the forward hook replaces, numbers from the
        cache's width; from 0 it stays inside the table."""
        if not self.own_forward():
            return None
        args = tuple(0 if i == 2 else a for i, a in enumerate(args))
        return args, {k: 0 if k in CACHE_LENGTH_ARGUMENTS else v for k, v in kwargs.items()}

    def _true_positions_skipping_pads(self, module, args, kwargs, output):
        """Forward hook (M2M100): output [B, T, D] read at the true positions. HF numbers a token
        pad + cache_length + (its rank among the forward's non-pad tokens), and a pad token pad (a zero row); its
        one-token steps give pad + 1 + the token's position, which its decoder prompt forward gives too where no pad
        token precedes a non-pad one (``seq2seq_inputs`` refuses other decoder prompts)."""
        if not self.own_forward():
            return None
        ids = args[0] if args else kwargs.get("input_ids")
        pad, positions = module.padding_idx, self._positions()
        real = torch.ones_like(positions) if ids is None else (ids != pad).to(torch.int64)
        index = (pad + (positions + 1) * real).clamp(max=module.weights.shape[0] - 1)  # (fillers run past)
        # (TrOCR's sinusoids are a plain attribute, which model.to(device) leaves where they were built)
        rows = module.weights.index_select(0, index.view(-1).to(module.weights.device))
        return rows.view(*index.shape, -1).to(device=output.device, dtype=output.dtype)

    def _computed_positions(self, module, args, kwargs, output):
        """Forward hook (Pegasus-X): output [B, T, D] recomputed by the module's own forward at each row's true
        positions, given as position ids [B * T, 1] over the rows' embeddings flattened to [1, B * T, D] (HF gives
        the shared ``cache_length + arange(T)``, [T, 1], the same for every row)."""
        if not self.own_forward():
            return None
        embeds = args[0] if args else kwargs["inputs_embeds"]  # [B, T, D]
        flat = embeds.reshape(1, -1, embeds.shape[-1])
        return module.forward(flat, 0, self._positions().reshape(-1, 1)).view(embeds.shape[0], embeds.shape[1], -1)

    def _fsmt_step_positions(self, module, args, kwargs, output):
        """Forward hook (FSMT): output [B, T, D] read from its table where model.generate's one-token steps read it:
        pad + (token is not pad) + the token's position (transformers 5.17's steps, whose table forward takes no
        cache_length, read every token at pad + (token is not pad))."""
        if not self.own_forward():
            return None
        ids = args[0] if args else kwargs["input"]
        index = module.padding_idx + (ids != module.padding_idx).to(torch.int64)
        if self.fsmt_counts_steps:
            index = index + self._positions()
        return torch.nn.functional.embedding(index.clamp(max=module.weight.shape[0] - 1), module.weight)  # (fillers)
