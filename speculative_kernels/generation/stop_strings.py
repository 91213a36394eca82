"""HF's ``stop_strings``: the criterion on a tokenizer, and whether a row's tokens just completed a stop string
(checked on host token lists, so no device read; ``generate`` per row, ``SpeculativeDecoder.add_request`` per
request)."""

import torch


def stop_criterion(stop_strings: tuple[str, ...], tokenizer):
    """HF's ``StopStringCriteria`` for ``stop_strings`` (validated: ``settings.stop_strings``) on ``tokenizer``. Where
    it cannot be built on the tokenizer (one without a decoder: "substring not found"), model.generate fails the same
    way; the error then names stop_strings and the tokenizer."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    try:
        return StopStringCriteria(tokenizer=tokenizer, stop_strings=list(stop_strings))
    except ValueError as error:
        raise ValueError(f"stop_strings={list(stop_strings)!r}: transformers' StopStringCriteria cannot be built on "
                         f"this tokenizer ({type(tokenizer).__name__}: {error}); model.generate fails the same way "
                         "(it reads each token's text through the tokenizer's decoder)") from error


def completes_stop_string(criterion, tokens: list[int]) -> bool:
    """Whether the row ``tokens`` (host ids, oldest first) ends by completing one of ``criterion``'s stop strings:
    HF's check on the row's last ``maximum_token_len`` tokens, all it reads of them, so the cost does not grow with
    the row."""
    tail = getattr(criterion, "maximum_token_len", None)
    return bool(criterion(torch.tensor([tokens[-tail:] if tail else tokens], device="cpu"), None).any())
