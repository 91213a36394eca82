"""Public ops: the fused verification step, the draft-side sampler, KV compaction and prompt lookup.

Both take raw logits (float32, float16 or bfloat16) and apply HF's warping (temperature, top_k, top_p) inside the
op, so the draft's q is by construction the distribution its token was drawn from. Randomness is explicit: a
``generator``, or a ``seed`` and ``offset`` (ints or int64 tensors, device tensors allowed so CUDA graphs can capture
them), fed to counter-based Philox noise (``philox.py``, ``randomness.py``); under ``torch.compile`` pass seed and
offset (tensors), since dynamo cannot trace a ``torch.Generator``. The backends take them as ``Sampling``
and ``Randomness`` objects (``backends.py`` picks one).
"""

import torch

from . import backends
from .compaction import compact_kv
from .diagnostics import raise_for_invalid_rows, should_check
from .lookup import prompt_lookup
from .randomness import resolve_randomness
from .validation import check_logits, check_num_draft_tokens, check_same_device, check_sampling, check_tokens

__all__ = ["verify", "sample", "compact_kv", "prompt_lookup"]


def _greedy_seed(seed, generator, sampling):
    """The seed of a call: a greedy one (every row's temperature 0 as a python scalar) uses no random number, so
    with neither a seed nor a generator it takes seed 0 instead of drawing one from torch's default generator,
    which it leaves untouched (as HF's greedy decoding does). Per-row temperatures are device values: a seed is
    drawn as for sampling."""
    return 0 if seed is None and generator is None and sampling.greedy else seed


def verify(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    top_k_bound: int | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    offset: int | torch.Tensor = 0,
    backend: str = "auto",
    check: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification (accept/reject, residual or bonus sampling; greedy when temperature == 0).

    target_logits: [B, K+1, V] with K >= 1 (a [B, 1, V] target is refused: for a plain decoding step pass
    num_draft_tokens 0 for the row, or use ``sample``); draft_logits: [B, K, V], or None for a drafter without a
    distribution (one-hot q); draft_tokens: [B, K]. Returns (tokens [B, K+1] int64: the emitted tokens then -1
    padding, num_accepted [B] int64 in 0..n_b). Exactly the target's distribution under HF's warping with the same
    temperature/top_k/top_p.

    temperature / top_k / top_p: python scalars, or [B] tensors on the logits' device (float32/float64 temperature and
    top_p, int64 top_k; scalars and tensors may be mixed), one value per row; temperature 0 makes that row greedy.
    A row's result never depends on the other rows' parameters. A temperature above float32's largest value
    (3.4e38; e.g. 1e39, as a scalar or in a float64 tensor) is refused with ``ValueError`` naming ``temperature`` on
    every backend (a tensor's value by the checks below): the kernels hold it in float32, where it would be
    infinite. A top_k of the vocabulary size or
    more (any python int) is no cut.

    top_k_bound: a python int >= 1 the caller knows on the host (e.g. from its requests' settings), or None: with
    per-row top_k / top_p tensors, a V-length sort per row finds each row's cut; with a bound, one topk of the bound
    does (the same cut, bit for bit). It promises, for every sampled row: top_k <= top_k_bound, and top_k >= 1 where
    top_p < 1. A row that breaks it comes back as an invalid row (-1; the checked path raises ``ValueError`` naming
    ``top_k_bound`` and the rows), never with another cut; with scalars it is checked at once. A python top_k >= 1
    beside per-row tensors is used as the bound by itself.

    seed / offset: ints, or int64 tensors of shape [], [1] or [B] (device tensors allowed); or a ``generator``. A
    scalar or [1] seed is one key for the call, and row b draws its own numbers from it by its batch index. A [B]
    seed gives each row its value as the row's own key (the row index is not mixed in, so a row's numbers do not
    depend on its batch position): ``seed=torch.full((B,), s)`` is not ``seed=s``, every row draws the same numbers
    (identical rows give identical samples). For independent rows from one s, pass
    ``seed=ops.randomness.row_keys(torch.full((B,), s))``. A [B] offset is each row's step counter.

    num_draft_tokens: [B] int64 on the logits' device, n_b in 0..K (None: K for every row). Row b verifies only its
    first n_b drafts: it accepts a prefix of them, then emits the residual token at its first rejection i < n_b, or,
    having accepted all n_b, one token from p at position n_b (greedy: argmax there). Positions past n_b are never
    accepted and never read: draft tokens/logits at i >= n_b and target logits at j > n_b may hold anything (-1
    padding included). n_b = 0 is a plain decoding step: one token from softmax(warp(target_logits[b, 0])), drawn
    with this op's own Philox stream (``STREAM_POSITION`` + 0 at the call's seed/offset; ``sample`` uses
    ``STREAM_DRAFT``). The random numbers do not depend on n_b, so n_b == K gives exactly the result without it.

    ``check`` (default: on, except while compiling or capturing a CUDA graph) reads the result on the host and raises
    ``ValueError`` for non-finite logits (raw, or after the division by temperature when sampling), out-of-range
    draft tokens, an out-of-range seed/offset tensor, per-row temperature/top_k/top_p or num_draft_tokens value (the
    error names the argument and the rows); unchecked, such rows (seed/offset aside: see ``randomness.py``) come back
    with num_accepted == -1 and all tokens -1 for the caller to test. An explicit ``check=True`` cannot run while
    compiling or capturing a CUDA graph (the checks read the device): it raises an error naming ``check`` there
    (under ``torch.compile(fullgraph=True)``, dynamo's, with the message); pass ``check=False`` or leave the default.
    """
    check_logits("target_logits", target_logits, 3)
    check_tokens("draft_tokens", draft_tokens, 2)
    batch, num_positions, vocab = target_logits.shape
    num_draft = num_positions - 1
    if num_draft < 1:
        raise ValueError(f"target_logits must have K+1 >= 2 positions, got shape {tuple(target_logits.shape)}")
    if tuple(draft_tokens.shape) != (batch, num_draft):
        raise ValueError(f"draft_tokens must have shape [{batch}, {num_draft}], got {tuple(draft_tokens.shape)}")
    if draft_logits is not None:
        check_logits("draft_logits", draft_logits, 3)
        if tuple(draft_logits.shape) != (batch, num_draft, vocab):
            raise ValueError(
                f"draft_logits must have shape [{batch}, {num_draft}, {vocab}], got {tuple(draft_logits.shape)}"
            )
    check_same_device(target_logits=target_logits, draft_logits=draft_logits, draft_tokens=draft_tokens)
    num_draft_tokens = check_num_draft_tokens(num_draft_tokens, batch, target_logits.device)
    sampling = check_sampling(temperature, top_k, top_p, batch, target_logits.device, top_k_bound)
    impl = backends.implementation(backend, target_logits.device.type)
    randomness = resolve_randomness(_greedy_seed(seed, generator, sampling), offset, generator, batch,
                                    target_logits.device)
    tokens, num_accepted = impl.verify(target_logits, draft_logits, draft_tokens, sampling, randomness,
                                       num_draft_tokens)
    if top_k_bound is not None and sampling.rows is not None:
        broken = sampling.rows.breaks_top_k_bound()
        tokens = tokens.masked_fill(broken.unsqueeze(1), -1)
        num_accepted = num_accepted.masked_fill(broken, -1)
    if should_check(check, target_logits):
        raise_for_invalid_rows(num_accepted, sampling=sampling, randomness=randomness,
                               num_draft_tokens=num_draft_tokens, target_logits=target_logits,
                               draft_logits=draft_logits, draft_tokens=draft_tokens)
    return tokens, num_accepted


def sample(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    top_k_bound: int | None = None,
    generator: torch.Generator | None = None,
    seed: int | torch.Tensor | None = None,
    offset: int | torch.Tensor = 0,
    backend: str = "auto",
    check: bool | None = None,
) -> torch.Tensor:
    """Draft-side sampler: one token per row from softmax(warp(logits)) (argmax when temperature == 0).

    logits: [B, V]. Returns [B] int64. temperature / top_k / top_p / top_k_bound: scalars or [B] tensors, and the
    bound, as for ``verify`` (a temperature above float32's largest value is refused by name). seed / offset as for ``verify``: a [B] seed is
    each row's own key, so ``seed=torch.full((B,), s)`` draws the same numbers in every row, unlike ``seed=s``. Uses
    its own Philox stream, so reusing (seed, offset) with ``verify`` never reuses random numbers. Unchecked, a row
    with non-finite logits (raw, or after the division by temperature) or an invalid per-row parameter comes back
    as -1; ``check`` as for ``verify``.
    """
    check_logits("logits", logits, 2)
    sampling = check_sampling(temperature, top_k, top_p, logits.shape[0], logits.device, top_k_bound)
    impl = backends.implementation(backend, logits.device.type)
    randomness = resolve_randomness(_greedy_seed(seed, generator, sampling), offset, generator, logits.shape[0],
                                    logits.device)
    tokens = impl.sample(logits, sampling, randomness)
    if top_k_bound is not None and sampling.rows is not None:
        tokens = tokens.masked_fill(sampling.rows.breaks_top_k_bound(), -1)
    if should_check(check, logits):
        raise_for_invalid_rows(tokens, sampling=sampling, randomness=randomness, logits=logits)
    return tokens
