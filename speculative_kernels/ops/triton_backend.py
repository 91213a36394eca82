"""Triton backend of ``verify``/``sample``: fused split-row kernels, registered as torch custom ops.

Same signature and return contract as ``reference.py`` (``Sampling`` and ``Randomness`` objects, ``num_draft_tokens``;
the registered ops take them as flat arguments). Per-row parameters (``Sampling.rows``) are read from device tensors
by the kernels (``ROW_PARAMS``): one launch serves greedy and sampled rows; a per-row draft limit (``HAS_LIMIT``)
likewise. Launches: sampling 3 (stats, decide + race, finish),
greedy 2 (stats, finish); top_k/top_p add the torch ``warp_thresholds`` path (one float32 copy of z, written by
``scale_kernel`` so the cut is computed from the kernels' own z; top-k with one temperature alone takes the k-th
largest raw logit from a radix select (``triton_select.py``: no torch.topk), with top-p its topk over the raw logits,
and z is computed for the candidates only, with no copy of z: ``_cuts``; per-row parameters
with a host bound of their top_k, ``RowSampling.top_k_bound``, the ops' ``top_k_bound`` argument, take one topk of the
bound, not a sort per row). No host synchronisation, so the ops can be captured in CUDA graphs;
``torch.library.triton_op`` makes them visible to ``torch.compile(fullgraph=True)``. ``verify``/``sample`` call the
registered ops, or in plain eager mode their bodies with the kernels themselves (``eager.py``: torch's custom-op
dispatch cost more host time than the bodies).
"""

import dataclasses
import functools
from typing import Optional

import torch
from torch.library import triton_op, wrap_triton
from triton.runtime.interpreter import InterpretedFunction

from .backends import device_guard
from .eager import kernel_itself, plain_eager
from .philox import STREAM_DRAFT, STREAM_POSITION
from .randomness import Randomness
from .sampling import RowSampling, Sampling
from .triton_kernels import finish_greedy_kernel, scale_kernel, stats_kernel
from .triton_race import finish_sample_kernel, race_kernel
from .triton_select import kth_largest_index
from .warping import row_thresholds, rows_top_k_cut_of_logits, scale_logits, top_k_top_p_cut_of_logits, warp_thresholds

__all__ = ["Tuning", "launch_sample", "launch_verify", "sample", "verify"]

_INTERPRETED = isinstance(stats_kernel, InterpretedFunction)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch knobs. ``num_sms`` None means the device's SM count."""

    block_v: int = 2048  # pass-1 vocabulary tile per loop iteration (power of two)
    num_warps: int = 8  # for a full tile; scaled down with smaller tiles
    race_block_v: int = 1024  # race tile: Philox and two running (best, index) pairs per element cost registers
    race_num_warps: int = 4  # (sm_90, as the JIT builds it (triton_aot --resources): 128 registers per thread at
    #                           1024/4 warps, 164 at 2048/8)
    programs_per_sm: int = 4  # target grid size per pass, so a batch of one still fills the GPU
    max_chunks: int = 256  # bounds the per-program combine work of the decision step
    num_sms: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Plan:
    block_v: int
    num_warps: int
    race_block_v: int
    race_num_warps: int
    chunks: int  # pass 1: chunks per vocabulary row
    chunk_size: int
    race_chunks: int  # pass 2: chunks per raced row
    race_chunk_size: int
    block_k: int  # power of two >= K + 1
    block_c: int  # chunk-combine tile (independent of B: one compiled variant for every batch size)


def _interpreting() -> bool:
    """Whether the kernels were defined under TRITON_INTERPRET=1 (decided once, when triton.jit ran)."""
    return _INTERPRETED


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_tuning(device: torch.device) -> Tuning:
    if device.type == "cuda":
        return _cuda_tuning(device.index if device.index is not None else torch.cuda.current_device())
    return _INTERPRETER_TUNING


@functools.cache
def _cuda_tuning(device_index: int) -> Tuning:
    """One frozen ``Tuning`` per device (built once: a dataclass per call cost ~3 µs of host time)."""
    return Tuning(num_sms=_sm_count(device_index))


# Interpreter (CPU tests): big numpy tiles and one chunk per row are fastest.
_INTERPRETER_TUNING = Tuning(block_v=4096, race_block_v=4096, programs_per_sm=1, num_sms=1)


def _cdiv(x, y):
    """``triton.cdiv`` (the same expression, so a SymInt batch traces alike) without its ``constexpr_function``
    wrapper, which costs ~3 µs per host call: make_plan made ~20 such calls, a third of the op's host path."""
    return (x + (y - 1)) // y


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` of an int n >= 1 (see ``_cdiv``)."""
    return 1 << (n - 1).bit_length()


def make_plan(batch: int, num_positions: int, vocab: int, tuning: Tuning) -> Plan:
    """Chunking of both passes (python ints only: no device reads, traceable by torch.compile).

    The tiles are constexprs, which Triton needs as ints: under dynamic shapes (``torch.compile(dynamic=True)``,
    opcheck's AOT check) vocab and num_positions arrive as SymInts, and ``int()`` specialises the graph on them (a
    guard; they do not change in a decode loop). batch stays symbolic: it sets only the grid and chunk sizes.
    Plans of int sizes are memoised (a pure function of its arguments; a decode loop asks for the same few)."""
    if type(batch) is int and type(num_positions) is int and type(vocab) is int:
        return _int_plan(batch, num_positions, vocab, tuning)
    return _plan(batch, num_positions, vocab, tuning)


@functools.lru_cache(maxsize=256)
def _int_plan(batch: int, num_positions: int, vocab: int, tuning: Tuning) -> Plan:
    return _plan(batch, num_positions, vocab, tuning)


def _plan(batch, num_positions, vocab, tuning: Tuning) -> Plan:
    vocab, num_positions = int(vocab), int(num_positions)
    target = tuning.programs_per_sm * (tuning.num_sms or 1)

    def tile(block: int) -> int:
        return max(16, min(block, _next_power_of_2(vocab)))

    def split(rows: int, block: int) -> tuple[int, int]:
        tiles = _cdiv(vocab, block)
        chunks = max(1, min(_cdiv(target, rows), tiles, tuning.max_chunks))
        size = _cdiv(tiles, chunks) * block
        return _cdiv(vocab, size), size

    block_v, race_block_v = tile(tuning.block_v), tile(tuning.race_block_v)
    chunks, chunk_size = split(batch * num_positions, block_v)
    race_chunks, race_chunk_size = split(batch, race_block_v)
    # The combine tile covers the most chunks any batch size can get (B = 1), so that it is the same constexpr for
    # every B: a tile chosen from this call's chunks would compile a new kernel variant for each new batch size.
    most_chunks = max(split(1, block_v)[0], split(1, race_block_v)[0])
    return Plan(
        block_v=block_v,
        num_warps=max(1, min(tuning.num_warps, block_v // 256)),
        race_block_v=race_block_v,
        race_num_warps=max(1, min(tuning.race_num_warps, race_block_v // 256)),
        chunks=chunks,
        chunk_size=chunk_size,
        race_chunks=race_chunks,
        race_chunk_size=race_chunk_size,
        block_k=max(2, _next_power_of_2(num_positions)),
        block_c=min(64, _next_power_of_2(most_chunks)),
    )


def precise_math(device: torch.device) -> bool:
    """libdevice math on NVIDIA GPUs; the interpreter has none (and numpy rounds every op on its own)."""
    return device.type == "cuda" and torch.version.hip is None and not _interpreting()


def _traceable(kernel):
    """``wrap_triton(kernel)``, the registered ops' launches (this module's ``wrap_triton`` looked up at each launch:
    ``triton_aot.recording`` stands in for it)."""
    return wrap_triton(kernel)


def _scaled(logits: torch.Tensor, sampling: Sampling, plan: Plan, wrap=_traceable) -> torch.Tensor:
    """z [B*J, V] float32 of the logits [B, J, V], bit for bit the z the other kernels compute (``scale_kernel``)."""
    batch, rows, vocab = logits.shape
    params = sampling.rows
    z = torch.empty(batch * rows, vocab, dtype=torch.float32, device=logits.device)
    grid = (batch * rows, _cdiv(vocab, plan.block_v))
    wrap(scale_kernel)[grid](
        logits, logits.stride(0), logits.stride(1), logits.stride(2), z,
        params.temperature if params is not None else z, rows, vocab, sampling.temperature,
        SCALE=params is not None or sampling.temperature != 1.0, ROW_PARAMS=params is not None,
        BLOCK_V=plan.block_v, num_warps=plan.num_warps,
    )
    return z


def _cuts(logits: torch.Tensor, sampling: Sampling, plan: Plan, wrap=_traceable):
    """Per-row (cut_value, cut_index) of the warped logits [B, J, V], flattened to [B*J].

    One temperature with top-k (alone or with top-p) writes no float32 copy of z: its select (top-k alone:
    ``triton_select``'s radix select) or topk (with top-p) runs over the raw logits and z is computed for the
    candidates only (``scale_logits``: a true division by float32(T), as the kernels'
    ``div_rn``, so bit for bit their z); the rest scales the whole row with ``scale_kernel``."""
    batch, rows, vocab = logits.shape
    params = sampling.rows
    if sampling.top_k_alone(vocab):
        # top-k alone: the k-th largest raw logit by a radix select over the logits' bits (triton_select.py; no
        # torch.topk), the cut value the z of that element: bit for bit warp_thresholds' value; index 0 either way
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        source = kth_largest_index(logits, sampling.top_k, plan.block_v, plan.chunk_size, wrap)
        source = source.to(torch.int64).unsqueeze(-1)  # [B, J, 1] (no reshape: a strided view stays one)
        cut_value = scale_logits(logits.gather(-1, source), sampling.temperature).reshape(-1)
        cut_index = torch.zeros(batch * rows, dtype=torch.int32, device=logits.device)
    elif sampling.top_k_with_top_p(vocab):
        cut_value, cut_index = (c.reshape(-1) for c in top_k_top_p_cut_of_logits(
            logits, sampling.temperature, sampling.top_k, sampling.top_p))
    elif params is None:
        cut_value, cut_index = warp_thresholds(_scaled(logits, sampling, plan, wrap), sampling.top_k, sampling.top_p)
    else:  # greedy rows get no cut: their z (temperature read as 1) must stay their logits
        per_position = (lambda t: t.view(batch, 1).expand(batch, rows).reshape(-1))
        if params.top_k_bound is not None and 0 < params.top_k_bound < vocab:  # (no copy of z, as above)
            per_row = (lambda t: t.view(batch, 1).expand(batch, rows))  # [B, J]: the logits are not reshaped
            cut_value, cut_index = rows_top_k_cut_of_logits(
                logits, per_row(params.safe_temperature()), per_row(params.sampled_top_k()),
                per_row(params.sampled_top_p()), params.top_k_bound)
            return cut_value.reshape(-1).contiguous(), cut_index.reshape(-1).contiguous()
        cut_value, cut_index = row_thresholds(_scaled(logits, sampling, plan, wrap),
                                              per_position(params.sampled_top_k()),
                                              per_position(params.sampled_top_p()), params.top_k_bound)
    return cut_value.contiguous(), cut_index.contiguous()


def _stats(target, draft, cuts, sampling: Sampling, limit, plan: Plan, precise: bool, wrap):
    """Pass 1 -> (float32 workspace [2 (+1 per-row), B*NR, C], int32 workspace [2, B*NR, C], plane size)."""
    batch, num_positions, vocab = target.shape
    num_draft = num_positions - 1
    num_rows = num_positions + (num_draft if draft is not None else 0)
    plane = batch * num_rows * plan.chunks
    params = sampling.rows
    ws_f = torch.empty((2 if params is None else 3) * plane, dtype=torch.float32, device=target.device)
    ws_i = torch.empty(2 * plane, dtype=torch.int32, device=target.device)
    d = draft if draft is not None else target
    cut_tv, cut_ti, cut_dv, cut_di = cuts if cuts is not None else (ws_f, ws_i, ws_f, ws_i)
    wrap(stats_kernel)[(batch * num_positions, plan.chunks)](
        target, target.stride(0), target.stride(1), target.stride(2),
        d, d.stride(0), d.stride(1), d.stride(2),
        cut_tv, cut_ti, cut_dv, cut_di,
        params.temperature if params is not None else ws_f, limit if limit is not None else ws_i,
        ws_f, ws_i, plane,
        vocab, num_draft, plan.chunk_size, sampling.temperature,
        HAS_DRAFT=draft is not None, HAS_CUT=cuts is not None, GREEDY=sampling.greedy,
        SCALE=params is not None or sampling.temperature != 1.0, ROW_PARAMS=params is not None,
        HAS_LIMIT=limit is not None, PRECISE=precise, BLOCK_V=plan.block_v, num_warps=plan.num_warps,
    )
    return ws_f, ws_i, plane


def _run(target, draft, tokens, sampling: Sampling, randomness: Randomness, stream_base: int, tuning: Tuning,
         out_shape, limit, wrap):
    """Shared driver. target [B, K+1, V]; draft [B, K, V] or None; tokens [B, K]; limit: num_draft_tokens [B] or None;
    wrap: ``_traceable`` (``wrap_triton``), or ``eager.kernel_itself`` where the caller knows that wrap_triton would
    return the kernel itself (``plain_eager``).

    Returns (tokens ``out_shape`` int64 = [B, K+1] or [B] when K = 0, num_accepted [B] int64)."""
    temperature, seed, offset = sampling.temperature, randomness.seed, randomness.offset
    params = sampling.rows
    batch, num_positions, vocab = target.shape
    num_draft = num_positions - 1
    if num_draft == 0:  # no draft position: q is never read (the race kernel would read the draft's cut at -1)
        draft = None
    device = target.device
    plan = make_plan(batch, num_positions, vocab, tuning)
    precise = precise_math(device)
    greedy = sampling.greedy
    out = torch.empty(out_shape, dtype=torch.int64, device=device)  # row stride K+1 either way
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    cuts = None
    if sampling.cuts(vocab):
        cuts = _cuts(target, sampling, plan, wrap)
        if draft is not None:
            cuts = cuts + _cuts(draft, sampling, plan, wrap)
        else:
            cuts = cuts + cuts
    ws_f, ws_i, plane = _stats(target, draft, cuts, sampling, limit, plan, precise, wrap)
    token_args = (tokens, tokens.stride(0), tokens.stride(1))
    out_args = (out, num_positions, num_accepted)
    limit_arg = limit if limit is not None else ws_i
    if greedy:
        wrap(finish_greedy_kernel)[(batch,)](
            ws_f, ws_i, plane, *token_args, limit_arg, *out_args, vocab, num_draft, plan.chunks,
            HAS_DRAFT=draft is not None, HAS_LIMIT=limit is not None, BLOCK_K=plan.block_k, BLOCK_C=plan.block_c,
            num_warps=1,
        )
        return out, num_accepted
    race_plane = batch * plan.race_chunks
    race_f = torch.empty(2 * race_plane, dtype=torch.float32, device=device)
    race_i = torch.empty(3 * race_plane + (2 if params is None else 4) * batch, dtype=torch.int32, device=device)
    d = draft if draft is not None else target
    cut_tv, cut_ti, cut_dv, cut_di = cuts if cuts is not None else (ws_f, ws_i, ws_f, ws_i)
    residual = num_draft > 0
    wrap(race_kernel)[(batch, plan.race_chunks)](
        target, target.stride(0), target.stride(1), target.stride(2),
        d, d.stride(0), d.stride(1), d.stride(2),
        *token_args,
        cut_tv, cut_ti, cut_dv, cut_di,
        seed, seed.stride(0), offset, offset.stride(0),
        params.temperature if params is not None else ws_f, limit_arg,
        ws_f, ws_i, plane,
        race_f, race_i, batch,
        vocab, num_draft, plan.chunks, plan.race_chunk_size, temperature, int(randomness.seed_per_row), stream_base,
        HAS_DRAFT=draft is not None, HAS_CUT=cuts is not None, SCALE=params is not None or temperature != 1.0,
        RESIDUAL=residual, ROW_PARAMS=params is not None, HAS_LIMIT=limit is not None,
        PRECISE=precise, BLOCK_K=plan.block_k, BLOCK_C=plan.block_c, BLOCK_V=plan.race_block_v,
        num_warps=plan.race_num_warps,
    )
    wrap(finish_sample_kernel)[(batch,)](
        race_f, race_i, batch, *token_args, *out_args, num_draft, plan.race_chunks,
        RESIDUAL=residual, ROW_PARAMS=params is not None, BLOCK_K=plan.block_k, BLOCK_C=plan.block_c, num_warps=1,
    )
    if params is not None:  # a row with an invalid parameter is flagged like an invalid input (reference.py)
        bad = params.out_of_range()
        out.masked_fill_(bad.view(-1, *([1] * (out.dim() - 1))), -1)
        num_accepted.masked_fill_(bad, -1)
    return out, num_accepted


def launch_verify(target_logits, draft_logits, draft_tokens, sampling: Sampling, randomness: Randomness,
                  tuning: Optional[Tuning] = None, num_draft_tokens: Optional[torch.Tensor] = None, wrap=_traceable):
    """``verify`` with explicit launch knobs (tests force small tiles and many chunks through this)."""
    tuning = tuning or default_tuning(target_logits.device)
    with device_guard(target_logits.device):
        return _run(target_logits, draft_logits, draft_tokens, sampling, randomness, STREAM_POSITION, tuning,
                    tuple(target_logits.shape[:2]), num_draft_tokens, wrap)


def launch_sample(logits, sampling: Sampling, randomness: Randomness, tuning: Optional[Tuning] = None,
                  wrap=_traceable):
    """``sample`` with explicit launch knobs: verify's machinery with K = 0 on the STREAM_DRAFT counters."""
    tuning = tuning or default_tuning(logits.device)
    batch = logits.shape[0]
    no_tokens = torch.empty(batch, 0, dtype=torch.int64, device=logits.device)
    with device_guard(logits.device):
        out, _ = _run(logits.unsqueeze(1), None, no_tokens, sampling, randomness, STREAM_DRAFT, tuning, (batch,),
                      None, wrap)
    return out


def _sampling(temperature: float, top_k: int, top_p: float, temperature_rows: Optional[torch.Tensor],
              top_k_rows: Optional[torch.Tensor], top_p_rows: Optional[torch.Tensor], row_cut: bool,
              top_k_bound: int) -> Sampling:
    """The ``Sampling`` of the registered ops' flat arguments (the *_rows tensors all given, or none; top_k_bound 0
    means no bound: ``RowSampling.top_k_bound`` None)."""
    if temperature_rows is None:
        return Sampling(temperature, top_k, top_p)
    return Sampling(rows=RowSampling(temperature_rows, top_k_rows, top_p_rows, row_cut,
                                     top_k_bound=top_k_bound if top_k_bound > 0 else None))


def _flat(sampling: Sampling) -> tuple:
    """``Sampling`` -> the registered ops' flat arguments (temperature, top_k, top_p, the three [B] tensors or None,
    row_cut, top_k_bound: ``RowSampling.top_k_bound``, 0 for none). A top_k past int64 (which the op's ``int`` cannot
    hold) is the largest int64: any top_k of the vocabulary size or more is no cut, as on the other backends (a bound
    past it likewise: a bound of V or more is no bound)."""
    rows = sampling.rows
    largest = torch.iinfo(torch.int64).max
    if rows is None:
        top_k = min(int(sampling.top_k), largest)
        return float(sampling.temperature), top_k, float(sampling.top_p), None, None, None, False, 0
    bound = min(int(rows.top_k_bound), largest) if rows.top_k_bound is not None else 0
    return 1.0, 0, 1.0, rows.temperature, rows.top_k, rows.top_p, bool(rows.cut), bound


@triton_op("speculative_kernels::verify_triton", mutates_args=())
def verify_triton(
    target_logits: torch.Tensor,
    draft_logits: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    temperature_rows: Optional[torch.Tensor],
    top_k_rows: Optional[torch.Tensor],
    top_p_rows: Optional[torch.Tensor],
    row_cut: bool,
    top_k_bound: int,
    seed: torch.Tensor,
    offset: torch.Tensor,
    seed_per_row: bool,
    num_draft_tokens: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [B, K+1, V]; draft_logits [B, K, V] or None; draft_tokens [B, K]; per-row temperature [B]
    float32, top_k [B] int64, top_p [B] float64 (all or none); top_k_bound: ``RowSampling.top_k_bound`` (0: none);
    seed, offset [B] int64; num_draft_tokens [B] int64 or None."""
    return _verify_body(target_logits, draft_logits, draft_tokens, temperature, top_k, top_p, temperature_rows,
                        top_k_rows, top_p_rows, row_cut, top_k_bound, seed, offset, seed_per_row, num_draft_tokens)


def _verify_body(target_logits, draft_logits, draft_tokens, temperature, top_k, top_p, temperature_rows, top_k_rows,
                 top_p_rows, row_cut, top_k_bound, seed, offset, seed_per_row, num_draft_tokens, wrap=_traceable):
    """``verify_triton``'s body, which ``verify`` also calls directly in plain eager mode (``eager.py``)."""
    sampling = _sampling(temperature, top_k, top_p, temperature_rows, top_k_rows, top_p_rows, row_cut, top_k_bound)
    return launch_verify(target_logits, draft_logits, draft_tokens, sampling, Randomness(seed, offset, seed_per_row),
                         num_draft_tokens=num_draft_tokens, wrap=wrap)


@triton_op("speculative_kernels::sample_triton", mutates_args=())
def sample_triton(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    temperature_rows: Optional[torch.Tensor],
    top_k_rows: Optional[torch.Tensor],
    top_p_rows: Optional[torch.Tensor],
    row_cut: bool,
    top_k_bound: int,
    seed: torch.Tensor,
    offset: torch.Tensor,
    seed_per_row: bool,
) -> torch.Tensor:
    """logits [B, V]; per-row parameters as ``verify_triton``; seed, offset [B] int64 -> tokens [B] int64."""
    return _sample_body(logits, temperature, top_k, top_p, temperature_rows, top_k_rows, top_p_rows, row_cut,
                        top_k_bound, seed, offset, seed_per_row)


def _sample_body(logits, temperature, top_k, top_p, temperature_rows, top_k_rows, top_p_rows, row_cut, top_k_bound,
                 seed, offset, seed_per_row, wrap=_traceable):
    """``sample_triton``'s body, which ``sample`` also calls directly in plain eager mode (``eager.py``)."""
    sampling = _sampling(temperature, top_k, top_p, temperature_rows, top_k_rows, top_p_rows, row_cut, top_k_bound)
    return launch_sample(logits, sampling, Randomness(seed, offset, seed_per_row), wrap=wrap)


def verify(target_logits, draft_logits, draft_tokens, sampling: Sampling, randomness: Randomness,
           num_draft_tokens: Optional[torch.Tensor] = None):
    """Same contract as ``reference.verify_reference``. The registered op, or its body with the kernels launched
    directly where nothing but the op's body would see the call (plain eager mode, ``eager.plain_eager``): the same
    arguments reach the same code either way."""
    args = (target_logits, draft_logits, draft_tokens, *_flat(sampling), randomness.seed, randomness.offset,
            bool(randomness.seed_per_row), num_draft_tokens)
    if plain_eager(args):
        return _verify_body(*args, wrap=kernel_itself)
    return torch.ops.speculative_kernels.verify_triton(*args)


def sample(logits, sampling: Sampling, randomness: Randomness):
    """Same contract as ``reference.sample_reference``; the registered op or its body, as ``verify``."""
    args = (logits, *_flat(sampling), randomness.seed, randomness.offset, bool(randomness.seed_per_row))
    if plain_eager(args):
        return _sample_body(*args, wrap=kernel_itself)
    return torch.ops.speculative_kernels.sample_triton(*args)
