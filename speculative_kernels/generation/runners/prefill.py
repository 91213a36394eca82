"""``prefill``: a runner's forward over prompts, in chunks of at most ``chunk_size`` tokens (HF's
``prefill_chunk_size``: ``GenerationMixin._prefill`` splits the prompt with ``torch.split`` along the sequence and
runs one forward per chunk, filling the cache; the last chunk's logits give the next token). Every prefill forward
of the package goes through it: a long prompt's prefill then holds the activations and attention masks of at
most chunk_size queries at a time."""

import torch

from .protocol import Runner


def prefill(runner: Runner, tokens: torch.Tensor, real: torch.Tensor | None,
            chunk_size: int | None, remainder_first: bool = False) -> torch.Tensor:
    """Run tokens [B, L] (real [B, L] bool: False at a left pad; None: all real) at the runner's next L slots, in
    forwards of at most ``chunk_size`` tokens (None: one forward). Returns the last position's logits [B, 1, V].

    remainder_first: the short chunk (L mod chunk_size tokens) runs first rather than last (HF's order), so that no
    forward after the first is one token wide (``ModelSpec.prompt_remainder_first``: a one-token forward takes a
    Mamba2 mixer's unclamped step). The caller refuses chunk_size 1 there (``request.build_loop``)."""
    width = tokens.shape[1]
    step = max(width, 1) if chunk_size is None else chunk_size
    logits = None
    ends = list(range(step, width, step)) + [width]
    if remainder_first and width % step:
        ends = [width % step] + [end + width % step for end in ends[:-1]]
    for start, end in zip([0] + ends[:-1], ends):  # (an empty prompt: one forward, as without chunks)
        chunk_real = None if real is None else real[:, start:end]
        logits = runner.forward(tokens[:, start:end], chunk_real, last_only=True, prompt=True)
    return logits


def prompt_real(real: torch.Tensor, all_real: bool) -> torch.Tensor | None:
    """What ``prefill`` takes for prompts with real [B, L] bool (False at a left pad or a masked token): None where
    ``all_real`` (a host fact, ``bool(real.all())`` read once while setting up, not in an iteration), so that an
    unpadded prompt's forward gets no 4-D mask (``DecoderRunner._mask``); else real."""
    return None if all_real else real


def prefill_forwards(width: int, chunk_size: int | None) -> int:
    """The forwards ``prefill`` runs over a prompt ``width`` tokens wide: ceil(width / chunk_size)."""
    return 1 if chunk_size is None else max(1, -(-width // chunk_size))
