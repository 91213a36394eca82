"""Plain-PyTorch reference of the verification step and the draft sampler.

This module defines the semantics every kernel backend must reproduce (greedy bit-exact; sampling with the same
Philox counters, see ``philox.py``). Leviathan et al. 2023, Algorithm 1:

* p_j = softmax(warp(target_logits[:, j])), q_i = softmax(warp(draft_logits[:, i])) (HF warping, ``warping.py``);
  ``draft_logits=None`` means a one-hot q at the draft token (drafters with no distribution, e.g. n-gram).
* Draft token x_i is accepted iff q_i(x_i) > 0 and r_i * q_i(x_i) < p_i(x_i), r_i = uniform(ACCEPT, c0=i), which is
  r_i < p/q without a division; a token with q = 0 is never accepted and r = 0 never accepts a p = 0 token.
* n = the number accepted before the first rejection. The next token is drawn at position n from
  max(0, p_n - q_n) after a rejection, from p_K when all K were accepted, and from p_n if the residual is all zero.
  Drawing is an exponential race, argmax_v w_v / E_v with E_v = exponential(word v % 4 of POSITION + n, c0=v // 4):
  the weights need no normalisation and the result is a sample from w / sum(w).
* Greedy (temperature == 0): accept while x_i == argmax z_i (first index on ties, float32 logits), then emit
  argmax z_n. top_k / top_p cannot change an argmax, so they are irrelevant there.
* A row with NaN or +inf in any of its logits, a row whose logits are all -inf, or a draft token outside [0, V)
  is invalid: its num_accepted is -1 and its tokens are all -1 (the public op turns that into an error). When
  sampling, the same test applies to the scaled logits z = float32(logits) / temperature, what the softmax sees:
  a finite logit that overflows float32 when scaled (3e38 at temperature 0.5), or a row that every logit leaves
  for -inf, is invalid too (HF's sampler raises on the NaN probabilities such a row gives).
* Per-row draft limit n_b (``num_draft_tokens`` [B], 0..K): row b accepts only among its first n_b drafts; all n_b
  accepted, the next token is drawn from p_{n_b} (q_{n_b} := 0; greedy: argmax z_{n_b}). n_b = 0 is a plain step:
  one token from p_0 raced with the STREAM_POSITION + 0 noise. The random numbers are those of the unlimited call,
  so n_b = K is that call bit for bit. Positions past n_b (target j > n_b, drafts i >= n_b) are never read: they
  cannot invalidate the row. A limit outside 0..K makes the row invalid.
* Per-row parameters (``Sampling.rows``): row b uses its own temperature / top_k / top_p for every position, exactly
  as the scalar call with those values would (``warping.row_thresholds``); temperature 0 makes the row greedy
  (it is then judged on its raw logits). A row with an invalid parameter is invalid.
"""

import torch

from .philox import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_POSITION,
    exponential_from_bits,
    philox_first_word,
    uniform_from_bits,
    vocabulary_bits,
)
from .randomness import Randomness
from .sampling import Sampling
from .warping import apply_thresholds, row_thresholds, scale_logits, warp_logits


def invalid_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, ..., V] -> [B] bool: any NaN / +inf, or any vocabulary row that is entirely -inf."""
    return invalid_positions(logits).reshape(logits.shape[0], -1).any(dim=1)


def _row_ids(batch: int, seed_per_row: bool, device: torch.device) -> torch.Tensor:
    if seed_per_row:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    return torch.arange(batch, dtype=torch.int64, device=device)


def race_noise(randomness: Randomness, stream: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exponential noise E[b, v] for one race per row: id v from word v % 4 of the call at c0 = v // 4
    (``vocabulary_bits``). stream: [B] int64. Returns [B, V] float32."""
    seed = randomness.seed
    rows = _row_ids(seed.shape[0], randomness.seed_per_row, seed.device).unsqueeze(1)
    bits = vocabulary_bits(seed.unsqueeze(1), vocab, rows, randomness.offset.unsqueeze(1), stream.unsqueeze(1))
    return exponential_from_bits(bits)


def accept_uniforms(randomness: Randomness, num_draft: int) -> torch.Tensor:
    """r[b, i] in [0, 1) for the accept test. Returns [B, K] float32."""
    seed = randomness.seed
    i = torch.arange(num_draft, dtype=torch.int64, device=seed.device).unsqueeze(0)
    rows = _row_ids(seed.shape[0], randomness.seed_per_row, seed.device).unsqueeze(1)
    stream = seed.new_full((), STREAM_ACCEPT)  # made on the device: no host copy, so CUDA graphs can capture it
    bits = philox_first_word(seed.unsqueeze(1), i, rows, randomness.offset.unsqueeze(1), stream)
    return uniform_from_bits(bits)


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax_v weights / noise (first index on ties). [B, V] x [B, V] -> [B] int64."""
    return torch.argmax(weights / noise, dim=-1)


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor, invalid: torch.Tensor):
    """Assemble [B, K+1] output: accepted drafts, the next token, then -1; invalid rows all -1 with n = -1."""
    batch, num_draft = draft_tokens.shape
    pos = torch.arange(num_draft + 1, device=draft_tokens.device).unsqueeze(0)
    n = num_accepted.unsqueeze(1)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    out = torch.where(pos < n, padded, torch.where(pos == n, next_token.unsqueeze(1), -1))
    out = out.masked_fill(invalid.unsqueeze(1), -1)
    return out.to(torch.int64), num_accepted.masked_fill(invalid, -1).to(torch.int64)


def _used(flags: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """[B, J] flags, [B, J] used positions -> [B] bool: any flag at a used position."""
    return (flags & used).any(dim=1)


def _all_used(flags: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """``_used`` where every position is used (no per-row draft limit)."""
    return flags.any(dim=1)


def _scaled_check_covers_raw(sampling: Sampling) -> bool:
    """Whether the check of the scaled logits z = float32(logits) / T (``_warped_probs``) flags every row that the
    raw logits' check would: sampling at T > 0 (per row: rows with an invalid T are flagged by ``out_of_range``,
    greedy rows divide by 1) keeps NaN, +inf and all -inf as they are, so the raw check is then redundant."""
    return sampling.rows is not None or (not sampling.greedy and sampling.temperature > 0.0)


def _count_prefix(accepted: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row. [B, K] bool -> [B] int64."""
    return accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)


def draft_limit(num_draft_tokens: torch.Tensor | None, batch: int, num_draft: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """num_draft_tokens [B] (or None: K for every row) -> (n_b clamped to 0..K [B] int64, out of range [B] bool)."""
    if num_draft_tokens is None:
        return torch.full((batch,), num_draft, dtype=torch.int64, device=device), torch.zeros(
            batch, dtype=torch.bool, device=device)
    limit = num_draft_tokens.to(torch.int64)
    return limit.clamp(0, num_draft), (limit < 0) | (limit > num_draft)


def used_positions(limit: torch.Tensor, num_draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """limit [B] -> (target positions j <= n_b [B, K+1], draft positions i < n_b [B, K]) as bool masks."""
    j = torch.arange(num_draft + 1, device=limit.device).unsqueeze(0)
    return j <= limit.unsqueeze(1), j[:, :num_draft] < limit.unsqueeze(1)


def invalid_positions(logits: torch.Tensor) -> torch.Tensor:
    """[B, J, V] -> [B, J] bool: the position's logits hold NaN / +inf, or are all -inf. One pass: the maximum over
    the vocabulary is NaN if any entry is (amax propagates NaN), +inf if any is, -inf if all are; finite otherwise."""
    return ~(logits.amax(dim=-1).abs() < float("inf"))  # (NaN < inf is False)


def _greedy(target_logits: torch.Tensor, tokens: torch.Tensor, in_draft: torch.Tensor):
    """Accept while x_i == argmax z_i (i < n_b), then argmax z_n. Returns (n [B], next token [B])."""
    best = target_logits.to(torch.float32).argmax(dim=-1)  # [B, K+1]
    n = _count_prefix((tokens == best[:, :tokens.shape[1]]) & in_draft)
    return n, best.gather(1, n.unsqueeze(1)).squeeze(1)


def _warped_probs(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, J, V] -> (softmax(warp(logits)) [B, J, V], invalid scaled positions [B, J]). Per-row parameters
    apply to every position of a row; greedy rows use temperature 1 and no cut (their probabilities are unused)."""
    if sampling.rows is None:
        z = scale_logits(logits, sampling.temperature)  # validity is judged on what softmax sees
        return torch.softmax(warp_logits(z, 1.0, sampling.top_k, sampling.top_p), dim=-1), invalid_positions(z)
    rows = sampling.rows
    z = logits.to(torch.float32) / rows.safe_temperature().view(-1, 1, 1)
    warped = z
    if rows.cut:
        cut = row_thresholds(z, rows.sampled_top_k().view(-1, 1), rows.sampled_top_p().view(-1, 1), rows.top_k_bound)
        warped = apply_thresholds(z, *cut)
    return torch.softmax(warped, dim=-1), invalid_positions(z)


def verify_reference(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, draft_tokens: torch.Tensor,
                     sampling: Sampling, randomness: Randomness,
                     num_draft_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference verification. target_logits: [B, K+1, V]; draft_logits: [B, K, V] or None; draft_tokens: [B, K];
    num_draft_tokens: [B] int64 in 0..K or None (K). Returns (tokens [B, K+1] int64 with -1 padding,
    num_accepted [B] int64 in 0..n_b)."""
    batch, num_draft = draft_tokens.shape
    vocab = target_logits.shape[-1]
    tokens = draft_tokens.to(torch.int64)
    limit, bad_limit = draft_limit(num_draft_tokens, batch, num_draft, target_logits.device)
    in_target, in_draft = used_positions(limit, num_draft)
    used = _used if num_draft_tokens is not None else _all_used  # (every position is used without a limit)
    invalid = bad_limit | used((tokens < 0) | (tokens >= vocab), in_draft)
    if sampling.rows is not None:
        invalid |= sampling.rows.out_of_range()
    if not _scaled_check_covers_raw(sampling):
        invalid |= used(invalid_positions(target_logits), in_target)
        if draft_logits is not None:
            invalid |= used(invalid_positions(draft_logits), in_draft)
    safe_tokens = tokens.clamp(0, vocab - 1).unsqueeze(-1)

    if sampling.greedy:
        return _emit(tokens, *_greedy(target_logits, tokens, in_draft), invalid)

    p, invalid_z = _warped_probs(target_logits, sampling)  # [B, K+1, V]
    invalid |= used(invalid_z, in_target)
    if draft_logits is None:
        q = torch.zeros(batch, num_draft, vocab, dtype=torch.float32, device=p.device)
        q.scatter_(-1, safe_tokens, 1.0)
    else:
        q, invalid_z = _warped_probs(draft_logits, sampling)
        invalid |= used(invalid_z, in_draft)
    p_x = p[:, :num_draft].gather(-1, safe_tokens).squeeze(-1)
    q_x = q.gather(-1, safe_tokens).squeeze(-1)
    r = accept_uniforms(randomness, num_draft)
    n = _count_prefix((q_x > 0) & (r * q_x < p_x) & in_draft)

    rows = torch.arange(batch, device=p.device)
    p_n = p[rows, n]  # [B, V]
    # q := 0 once all n_b drafts are accepted (n = n_b <= K; below n_b, n < K indexes q itself; no draft: q is empty)
    q_n = (torch.where((n < limit).unsqueeze(1), q[rows, n.clamp(max=num_draft - 1)], 0.0) if num_draft > 0
           else torch.zeros_like(p_n))
    residual = torch.clamp(p_n - q_n, min=0.0)
    weights = torch.where((residual.amax(dim=-1) > 0).unsqueeze(1), residual, p_n)
    noise = race_noise(randomness, STREAM_POSITION + n, vocab)
    next_token = race(weights, noise)
    if sampling.rows is not None:
        greedy = sampling.rows.greedy
        n_greedy, next_greedy = _greedy(target_logits, tokens, in_draft)
        n, next_token = torch.where(greedy, n_greedy, n), torch.where(greedy, next_greedy, next_token)
    return _emit(tokens, n, next_token, invalid)


def sample_reference(logits: torch.Tensor, sampling: Sampling, randomness: Randomness) -> torch.Tensor:
    """Reference draft sampler: one token per row from softmax(warp(logits)), or argmax when temperature == 0.

    logits: [B, V]. Returns [B] int64; -1 for a row with NaN/+inf or all -inf logits
    (when sampling: scaled logits, see the module docstring) or an invalid per-row parameter. Uses the STREAM_DRAFT
    counters, so it never reuses numbers that verify draws with the same seed and offset.
    """
    if sampling.greedy:
        return logits.to(torch.float32).argmax(dim=-1).masked_fill(invalid_rows(logits), -1)
    p, invalid = _warped_probs(logits.unsqueeze(1), sampling)
    invalid = invalid.squeeze(1)
    if not _scaled_check_covers_raw(sampling):
        invalid |= invalid_rows(logits)
    stream = torch.full_like(randomness.seed, STREAM_DRAFT)
    token = race(p.squeeze(1), race_noise(randomness, stream, logits.shape[-1]))
    if sampling.rows is not None:
        invalid |= sampling.rows.out_of_range()
        token = torch.where(sampling.rows.greedy, logits.to(torch.float32).argmax(dim=-1), token)
    return token.masked_fill(invalid, -1)
