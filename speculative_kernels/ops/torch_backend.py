"""The plain-PyTorch backend: the reference implementation itself (any device, traceable by torch.compile), with
the greedy verification written in fewer ops (``verify_greedy``: the decode loop runs it every iteration on CPU)."""

import torch

from .randomness import Randomness
from .reference import sample_reference as sample
from .reference import verify_reference
from .sampling import Sampling

__all__ = ["sample", "verify", "verify_greedy"]


def verify(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, draft_tokens: torch.Tensor,
           sampling: Sampling, randomness: Randomness,
           num_draft_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.verify_reference``; greedy (every row, no per-row draft limit) through ``verify_greedy`` (the
    same results, bit for bit)."""
    if sampling.greedy and num_draft_tokens is None:
        return verify_greedy(target_logits, draft_logits, draft_tokens)
    return verify_reference(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens)


def verify_greedy(target_logits: torch.Tensor, draft_logits: torch.Tensor | None,
                  draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification in 17 ops (float32 logits). target_logits: [B, K+1, V]; draft_logits: [B, K, V] or
    None; draft_tokens: [B, K]. Returns (tokens [B, K+1] int64, num_accepted [B] int64), as ``verify_reference`` at temperature 0.

    One max over the vocabulary gives both the argmax (first index on ties) and the validity test: a position's
    maximum is NaN if it holds a NaN, +inf if it holds +inf, -inf if every logit is -inf, so a row is valid iff every
    maximum is finite (the draft's too) and every draft token is in [0, V). Accepted drafts equal the argmax at their
    positions, so the output is the argmax row cut after position n.
    """
    vocab = target_logits.shape[-1]
    num_draft = draft_tokens.shape[1]
    tokens = draft_tokens.to(torch.int64)
    maxima, best = target_logits.to(torch.float32).max(dim=-1)  # [B, K+1] each
    if draft_logits is not None:
        maxima = torch.cat([maxima, draft_logits.to(torch.float32).amax(dim=-1)], dim=1)
    in_vocab = tokens.clamp(0, vocab - 1) == tokens
    valid = torch.cat([maxima.abs() < float("inf"), in_vocab], dim=1).all(dim=1)  # (NaN < inf is False)
    n = (tokens == best[:, :num_draft]).cumprod(dim=1).sum(dim=1)
    n = torch.where(valid, n, -1)
    positions = torch.arange(num_draft + 1, device=best.device)
    return best.masked_fill(positions > n.unsqueeze(1), -1), n
