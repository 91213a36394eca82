"""HF's logits processors that read the tokens so far, applied exactly across a speculative block.

``model.generate`` runs its processor list (repetition penalties, n-gram bans, bad words, sequence bias, suppressed
tokens, the exponential length penalty, inf/NaN removal, the minimum length, forced tokens, a
``prefix_allowed_tokens_fn``, the caller's ``logits_processor``, a watermark) once per step on the sequence so far
(when sampling with a watermark, which HF applies after its warpers, each row's list is HF's whole chain: processors,
warpers, watermark; the verification then warps nothing itself). Here position
j of a block of T positions is processed with the row's tokens so far plus the block's first j tokens: whenever the
token at j is emitted, those j tokens were accepted, so every processor saw exactly what ``model.generate`` would
have shown it (HF's assisted generation does the same, at batch 1). The draft's logits get only the bans among the
block-processable processors (``draft_processors.py``: which, and why): exactness does not depend on q, which is
whatever the draft sampled from, and a draft of a banned token is a certain rejection
(``benchmarks/processors_batch.py``).

The lists are HF's own (``model._get_logits_processor``), built once per row on that row's inputs, so the
processors, their order and their details are the installed transformers' (e.g. whether the repetition penalty
skips left padding). Rows of a batch accept different numbers of tokens, so they are at different steps: each row's
list is applied in its order in runs (``split_into_stages``). A run of HF's common processors (repetition penalty,
n-gram ban, minimum length and new tokens, suppressed tokens, single-token bad words and sequence bias:
``block_processors.py``) is applied to the whole block of every row with such a run at once, [B, T, V] in a few
tensor ops, with the scores HF's own calls give at each row and position, bit for bit; any other processor is called
for each row alone, with input_ids [1, L] of that row's own length (B x T Python calls per processor per
iteration). HF's processors treat rows independently;
``prefix_allowed_tokens_fn`` is called with the row's index in the caller's batch, as in ``model.generate``. A
caller's ``logits_processor`` is taken at batch 1 only (a processor of its own may mix rows, which per-row calls
would silently change). As in HF's assisted generation, processors are also called at positions whose tokens are
then rejected: they must be functions of their arguments (no state carried from call to call).
"""

import copy
import functools
import inspect

import torch
from transformers.generation.logits_process import LogitsProcessor, PrefixConstrainedLogitsProcessor

from .block_processors import block_tokens, fast_op
from .settings import Plan
from .transfer import host_to_device


class _PerRow:
    """A per-row list (``rows``) that follows its batch's rows: leaving (``select_rows``), joining (``add_rows``)."""

    rows: list

    def select_rows(self, remaining: list[int]) -> None:
        """Keep rows ``remaining`` (host indices, in order)."""
        self.rows = [self.rows[i] for i in remaining]

    def add_rows(self, other: "_PerRow") -> None:
        """Append ``other``'s rows (rows joining a batch of requests)."""
        self.rows = self.rows + other.rows


class RowProcessors(_PerRow):
    """One HF ``LogitsProcessorList`` per row (``build_row_processors``), applied in its order in stages
    (``split_into_stages``): a run of HF's common processors over the block of every row of the same stages at once
    (``block_processors``), any other processor called per row and position as ``LogitsProcessorList.__call__``
    calls it (without its per-call signature inspection: a processor that needs more arguments than
    (input_ids, scores) is refused here, where HF's list would raise at its first call)."""

    def __init__(self, lists: list):
        for processors in lists:
            for processor in processors:
                if _needs_more_arguments(processor):
                    name = getattr(processor, "__name__", None) or type(processor).__name__
                    raise ValueError(f"logits processor {name} takes more arguments than (input_ids, scores); "
                                     "generate passes it none, as model.generate would not")
        self.rows = [list(processors) for processors in lists]
        self.stages = [split_into_stages(processors) for processors in self.rows]

    def select_rows(self, remaining: list[int]) -> None:
        super().select_rows(remaining)
        self.stages = [self.stages[i] for i in remaining]

    def add_rows(self, other: "RowProcessors") -> None:
        super().add_rows(other)
        self.stages = self.stages + other.stages

    def process(self, logits: torch.Tensor, contexts: list, block: torch.Tensor | None,
                rows: list[int]) -> dict[int, int]:
        """In place on logits [B, T, V] (float32). contexts[b]: row b's tokens before position 0 ([1, L_b] int64);
        block [B, >= T - 1] int64: the tokens at positions 0..T-2 (None when T == 1); rows: the rows to process
        (the others are left as they are).

        Returns {row: j} for the rows whose processors raised at a position j >= 1: there the context holds j draft
        tokens, a sequence ``model.generate`` may never build (a ``prefix_allowed_tokens_fn`` defined on valid
        prefixes only, as in constrained decoding; a processor's own bug on some inputs). Positions 0..j-1 are
        processed, so the row's first j drafts can be verified as usual; position j is set to 0 (finite logits)
        and the later stages leave the positions from j on as they are: the loop drops a token drawn there
        (``SpeculativeLoop._verify``). At position 0, whose context is the row's real tokens, what
        ``model.generate`` would process too, the error propagates."""
        caps = {}
        groups = {}  # rows whose lists have the same stages, processed together
        for b in rows:
            if self.rows[b]:  # (a row of a batch of requests without processors of its own: none)
                groups.setdefault(_stages_key(self.stages[b]), []).append(b)
        for members in groups.values():
            _StageRunner(logits, contexts, block, members, caps).run([self.stages[b] for b in members])
        return caps


class _StageRunner:
    """One call's processing of rows with the same stages (``RowProcessors.process``); caps: {row: j}, filled."""

    def __init__(self, logits: torch.Tensor, contexts: list, block: torch.Tensor | None, members: list[int],
                 caps: dict):
        self.logits, self.contexts, self.block, self.members, self.caps = logits, contexts, block, members, caps
        self.width = logits.shape[1]
        self._block_tokens = None  # (built at the first fast stage)
        self._row_tokens = {}  # row -> [1, L_b + T - 1] (built at the row's first per-row stage)

    def run(self, stages_per_row: list) -> None:
        for s, (fast, _) in enumerate(stages_per_row[0]):
            processors = [stages[s][1] for stages in stages_per_row]  # per member row: its processors of stage s
            if fast:
                self._fast(processors)
            else:
                for b, row_processors in zip(self.members, processors):
                    self._per_row(b, row_processors)

    def _fast(self, processors: list) -> None:
        """The stage's processors over the members' whole block at once; per row where one raises (an id HF's own
        indexing refuses; a bias processor before its first call, ``block_processors.Unprepared``): the per-row
        calls then do what HF does."""
        members = self.members
        every = members == list(range(self.logits.shape[0]))
        index = None if every else host_to_device(members, torch.int64, self.logits.device)
        old = self.logits if every else self.logits.index_select(0, index)
        try:
            if self._block_tokens is None:
                block = None if self.block is None or every else self.block.index_select(0, index)
                self._block_tokens = block_tokens([self.contexts[b] for b in members],
                                                  self.block if every else block, self.width)
            new = torch.nn.functional.pad(old, (0, 1))  # [R, T, V + 1]: a spare column for ids banned nowhere
            for i in range(len(processors[0])):
                row_processors = [p[i] for p in processors]
                fast_op(row_processors[0])(new, self._block_tokens, row_processors)
        except (IndexError, RuntimeError):
            for b, row_processors in zip(members, processors):
                self._per_row(b, row_processors)
            return
        new = new[..., :-1]
        for r, b in enumerate(members):  # (a row that raised at j keeps its positions from j on as they are)
            if b in self.caps:
                new[r, self.caps[b]:] = old[r, self.caps[b]:]
        if every:
            self.logits.copy_(new)
        else:
            self.logits.index_copy_(0, index, new)

    def _per_row(self, b: int, processors: tuple) -> None:
        """Row b's ``processors`` called at each of its positions (those before a position where an earlier stage
        raised), as ``LogitsProcessorList`` calls them."""
        logits, width = self.logits, self.width
        tokens = self._row_tokens.get(b)
        if tokens is None:
            context = self.contexts[b]
            tokens = context if width == 1 else torch.cat([context, self.block[b : b + 1, : width - 1]], dim=1)
            self._row_tokens[b] = tokens
        start = self.contexts[b].shape[1]
        for j in range(self.caps.get(b, width)):
            scores = logits[b : b + 1, j]
            try:
                for processor in processors:
                    run = functools.partial(_run_processor, processor, tokens[:, : start + j])
                    if type(processor).__name__.endswith("Warper"):  # (HF's warpers' naming)
                        scores = warp_valid_rows(run, scores)
                    else:
                        scores = run(scores)
            except Exception:
                if j == 0:
                    raise
                self.caps[b] = j
                # (a processor may have edited the position in place before raising: the verification still
                # draws a token there, dropped after, so it gets finite logits, never an invalid row's)
                logits[b : b + 1, j] = 0.0
                return
            row = logits[b : b + 1, j]
            if scores.data_ptr() != row.data_ptr():  # (else it is the row itself, edited in place, or a view of it)
                row.copy_(scores)


def split_into_stages(processors: list) -> list:
    """A row's processor list as its runs in order: [(fast, (processors, ...))], fast runs those ``block_processors``
    applies to a whole block at once (``fast_op``), the others called per row and position. HF's order is kept:
    each processor acts on what the ones before it returned."""
    stages = []
    for processor in processors:
        fast = fast_op(processor) is not None
        if stages and stages[-1][0] == fast:
            stages[-1] = (fast, stages[-1][1] + (processor,))
        else:
            stages.append((fast, (processor,)))
    return stages


def _stages_key(stages: list) -> tuple:
    """What rows processed together must share: each stage's kind, and a fast stage's processor classes in order."""
    return tuple((fast, tuple(type(p) for p in processors) if fast else None) for fast, processors in stages)


class RowWarpers(_PerRow):
    """Each row's own ``Warpers`` or None (a batch of separate requests: ``RowSettings.warpers``)."""

    def __init__(self, rows: list):
        self.rows = rows

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, ..., V] float32 -> a new tensor: each row with a chain warped by it, the others as given."""
        out = logits.clone()
        for b, warpers in enumerate(self.rows):
            if warpers is not None:
                out[b] = warpers(logits[b])
        return out


def build_row_processors(model, plan: Plan, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         encoder_input_ids: torch.Tensor | None) -> RowProcessors | None:
    """The per-row processor lists of a request, or None when it needs none (``plan.context_processing``).

    input_ids, attention_mask: [B, P] the (decoder) prompts as the loop holds them, left-padded; encoder_input_ids:
    [B, S] what HF passes as ``encoder_input_ids`` (decoder-only: the prompts; encoder-decoder: the encoder's input
    ids, or None when only ``encoder_outputs`` were given). Raises ValueError for a caller's ``logits_processor``
    with more than one row."""
    if not plan.context_processing:
        return None
    batch, width = input_ids.shape
    if plan.logits_processor and batch > 1:
        raise ValueError(
            f"logits_processor with a batch of {batch} prompts is not supported: rows accept different numbers of "
            "tokens, so each row is processed alone, which a processor of your own that mixes rows would not expect; "
            "run one prompt per call, or use generate's settings (repetition_penalty=, bad_words_ids=, ...), whose "
            "processors are applied row by row exactly")
    config = _processor_config(plan, width, input_ids.device)
    mask_name = "decoder_attention_mask" if model.config.is_encoder_decoder else "attention_mask"
    group = 1 if plan.prefix_allowed_tokens_fn is None else _prefix_rows_per_batch_id(model, plan, width,
                                                                                       input_ids.device)
    lists = []
    # HF's watermark processor builds an 8 MB random table per instance and keeps no per-row state (it reseeds its
    # generator from the row's tokens at every use): the rows after the first share row 0's (a batch of 4000 rows
    # built 32 GB of identical tables, where model.generate builds one)
    unwatermarked = copy.copy(config)
    unwatermarked.watermarking_config = None
    for b in range(batch):
        allowed = plan.prefix_allowed_tokens_fn
        if allowed is not None:  # called with the batch_id model.generate passes for this row
            allowed = _RowIndexed(allowed, b // group)
        encoder = None if encoder_input_ids is None else encoder_input_ids[b : b + 1]
        row = _hf_processors(
            model, generation_config=config if b == 0 else unwatermarked, input_ids_seq_length=width,
            encoder_input_ids=encoder, prefix_allowed_tokens_fn=allowed, logits_processor=list(plan.logits_processor),
            device=input_ids.device, model_kwargs={mask_name: attention_mask[b : b + 1]})
        if b > 0 and config.watermarking_config is not None:
            for i, processor in enumerate(lists[0]):  # (at its place in row 0's list: the order is HF's)
                if type(processor).__name__ == "WatermarkLogitsProcessor":
                    row.insert(i, processor)
        for i, processor in enumerate(row):  # (settings-only processors: row 0's instance serves every row)
            if b > 0 and type(processor) in _SHARED and i < len(lists[0]) and type(lists[0][i]) is type(processor):
                row[i] = lists[0][i]
        lists.append(row)
    return RowProcessors(lists)


def _shared_processor_types() -> tuple:
    """HF's processors that hold only the request's settings and tables derived from them (built at their first call:
    a [V] float32 bias per instance for bad_words_ids / sequence_bias), no per-row state: one instance serves
    every row of a batch, as in model.generate (a batch of B built B tables)."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

    return (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor)


_SHARED = _shared_processor_types()


def _needs_more_arguments(processor) -> bool:
    """Whether a processor called with (input_ids, scores) alone fails: HF's ``LogitsProcessorList`` refuses one
    whose ``__call__`` has more parameters (a LogitsProcessor's own; a plain function's ``__call__`` is
    ``*args, **kwargs``), and a function that requires a third argument fails when called. A function's third
    parameter with a default is fine, as in model.generate. A ``LogitsProcessor``'s answer is its class's (its
    ``__call__`` is the class's), worked out once per class: a call's rows each hold their own processors, and
    inspecting every row's took ~1 ms a row."""
    kind = type(processor)
    if isinstance(processor, LogitsProcessor) and "__call__" not in getattr(processor, "__dict__", {}):
        if kind not in _NEEDS_MORE_BY_CLASS:
            _NEEDS_MORE_BY_CLASS[kind] = _inspected_needs_more(processor)
        return _NEEDS_MORE_BY_CLASS[kind]
    return _inspected_needs_more(processor)


_NEEDS_MORE_BY_CLASS: dict = {}


def _inspected_needs_more(processor) -> bool:
    return len(_parameters(processor.__call__)) > 2 or len(_parameters(processor, required=True)) > 2


def _parameters(function, required: bool = False) -> list:
    """The names of ``function``'s parameters (required: only the positional ones without a default)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: taken as (input_ids, scores)
        return ["input_ids", "scores"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters
            if not required or (p.kind in positional and p.default is inspect.Parameter.empty)]


def _run_processor(processor, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``processor(input_ids, scores)`` (input_ids [1, L], scores [1, V]) as the row [1, V] it replaces.
    model.generate hands the return value on as it is: a [V] tensor (``scores[0]``) is chosen from there when greedy,
    and taken here. Anything else is named here: None (a processor without ``return scores``) fails inside torch
    there, another width makes it choose among the ids kept."""
    vocab_size = scores.shape[-1]
    scores = processor(input_ids, scores)
    name = getattr(processor, "__name__", None) or type(processor).__name__
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"logits processor {name} returned {type(scores).__name__}, not the "
                        f"scores tensor [1, {vocab_size}]")
    if scores.shape[-1:] != (vocab_size,) or scores.numel() != vocab_size:
        raise ValueError(f"logits processor {name} returned scores of shape "
                         f"{tuple(scores.shape)}, not [1, {vocab_size}] (one row of the vocabulary)")
    return scores.reshape(1, vocab_size)


def warp_valid_rows(warp, scores: torch.Tensor) -> torch.Tensor:
    """``warp(scores)`` for scores [N, V] float32, rows without a valid distribution (no finite logit, a NaN or +inf)
    passed through as they are: a block holds positions past drafts the target bans, which HF's generate never
    samples from, and where every token may be banned; some warpers raise on such a row (transformers 5.17's eta and
    top-H warpers, through torch.distributions' argument checks). The loop verifies a row no further than such a
    position past its first (``SpeculativeLoop._dead_positions``), and fails at the first, as HF would.
    No host read: the rows are chosen with ``torch.where``."""
    invalid = ~torch.isfinite(scores.amax(dim=-1, keepdim=True))  # (the max is NaN with any NaN, +inf with any +inf)
    return torch.where(invalid, scores, warp(torch.where(invalid, 0.0, scores)))


class Warpers:
    """HF's sampling warpers (temperature, top-k, top-p, min-p, typical, epsilon, eta: as the installed transformers
    builds and orders them), run on the logits before the verification when a warper the verification op lacks is
    set (``Plan.warping``). They read the scores only, so a whole block is warped at once."""

    def __init__(self, warpers: list):
        self.warpers = warpers

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] float32 -> the warped logits, a new tensor of the same shape."""
        flat = logits.reshape(-1, logits.shape[-1])
        ids = torch.zeros(flat.shape[0], 1, dtype=torch.int64, device=flat.device)  # (unread by the warpers)

        def chain(scores):
            for warper in self.warpers:
                scores = warper(ids, scores)
            return scores

        return warp_valid_rows(chain, flat).reshape(logits.shape)

    def select_rows(self, remaining: list[int]) -> None:
        """Rows leaving the batch (finished rows dropped): nothing to do, every row has this same chain."""


def build_warpers(model, plan: Plan, prompt_width: int, device: torch.device) -> Warpers | None:
    """HF's warper chain for the request (``plan.warping``), or None. Built by HF's own ``_get_logits_processor``
    twice, without and with do_sample: the warpers are what sampling adds, in HF's order."""
    if not plan.warping:
        return None
    config = _processor_config(plan, prompt_width, device)
    config.do_sample = False
    config.watermarking_config = None  # (the warpers alone: the watermark runs in the rows' lists)
    sampled = copy.copy(config)
    sampled.do_sample = True
    args = dict(input_ids_seq_length=prompt_width, device=device, model_kwargs={})
    base = _hf_processors(model, generation_config=config, **args)
    full = _hf_processors(model, generation_config=sampled, **args)
    return Warpers(list(full)[len(base):])


def _hf_processors(model, **kwargs):
    """HF's ``model._get_logits_processor(**kwargs)``: the list ``model.generate`` builds (a private method, the
    same from transformers 4.4x to 5.x; a version without it gets an error naming what needs it)."""
    build = getattr(model, "_get_logits_processor", None)
    if not callable(build):
        raise ValueError("logits processors and sampling warpers (repetition_penalty=, min_p=, logits_processor=, ...) "
                         "are built by transformers' GenerationMixin._get_logits_processor, which this transformers "
                         "lacks; leave those settings at their defaults")
    return build(**kwargs)


def _processor_config(plan: Plan, prompt_width: int, device: torch.device):
    """The request's GenerationConfig as ``model.generate`` holds it when it builds its processors: lengths
    resolved (``_prepare_generated_length``: max_length = prompt + new tokens, kept fractional when the caller's
    length was, so that the forced EOS never fires, as in HF; min_length = prompt + min_new_tokens where that is set,
    which stays set, so that HF builds both minimum processors and a caller's MinLengthLogitsProcessor replaces only
    its own; else the config's min_length), ``_eos_token_tensor`` set;
    without the warpers (the verification applies temperature/top-k/top-p itself) and without ``LogitNormalization``
    (applied to the returned scores only, last, as HF does)."""
    config = copy.deepcopy(plan.generation_config)
    given = config.max_new_tokens if config.max_new_tokens is not None else config.max_length
    fractional = given is not None and not float(given).is_integer()
    config.max_length = prompt_width + plan.max_new_tokens - (0.5 if fractional else 0)
    config.max_new_tokens = None
    if config.min_new_tokens is not None:
        config.min_length = prompt_width + config.min_new_tokens
    config._eos_token_tensor = (torch.tensor(plan.eos_token_ids, device=device) if plan.eos_token_ids else None)
    config.do_sample = plan.processors_warp  # (then HF's whole chain per row: its warpers, then the watermark)
    config.renormalize_logits = False
    # Each list is built for one row and called with that row alone: transformers 5.24's prefix processor groups
    # max(num_beams, num_return_sequences) rows per batch_id, which a one-row call would hold none of
    config.num_return_sequences = 1
    return config


def _prefix_rows_per_batch_id(model, plan: Plan, prompt_width: int, device: torch.device) -> int:
    """How many consecutive rows of the expanded batch ``model.generate`` gives one ``batch_id`` of
    prefix_allowed_tokens_fn: the ``num_beams`` its ``PrefixConstrainedLogitsProcessor`` is built with. transformers
    <= 5.23 passes num_beams (1 when sampling: each of num_return_sequences rows its own batch_id), 5.24
    max(num_beams, num_return_sequences) (the prompt's index). Read off the processor the installed transformers
    builds for this request, so either rule is followed."""
    config = _processor_config(plan, prompt_width, device)
    config.num_return_sequences = plan.generation_config.num_return_sequences
    built = _hf_processors(model, generation_config=config, input_ids_seq_length=prompt_width,
                           encoder_input_ids=None, prefix_allowed_tokens_fn=lambda batch_id, ids: [],
                           logits_processor=[], device=device, model_kwargs={})
    prefix = next(p for p in built if isinstance(p, PrefixConstrainedLogitsProcessor))
    return max(int(prefix._num_beams), 1)


class _RowIndexed:
    """prefix_allowed_tokens_fn called with a fixed row index (the row's place in the caller's batch)."""

    def __init__(self, fn, row: int):
        self.fn, self.row = fn, row

    def __call__(self, batch_id: int, input_ids: torch.Tensor):
        return self.fn(self.row, input_ids)


__all__ = ["RowProcessors", "RowWarpers", "Warpers", "build_row_processors", "build_warpers"]
