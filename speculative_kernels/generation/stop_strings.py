"""HF's ``stop_strings``: the criterion on a tokenizer, and whether a row's tokens just completed a stop string
(checked on host token lists, so no device read; ``generate`` per row, ``SpeculativeDecoder.add_request`` per
request)."""

import torch


def stop_criterion(stop_strings: tuple[str, ...], tokenizer):
    """HF's ``StopStringCriteria`` for ``stop_strings`` (validated: ``settings.stop_strings``) on ``tokenizer``."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    return StopStringCriteria(tokenizer=tokenizer, stop_strings=list(stop_strings))


def completes_stop_string(criterion, tokens: list[int]) -> bool:
    """Whether the row ``tokens`` (host ids, oldest first) ends by completing one of ``criterion``'s stop strings:
    HF's check on the row's last ``maximum_token_len`` tokens, all it reads of them, so the cost does not grow with
    the row."""
    tail = getattr(criterion, "maximum_token_len", None)
    return bool(criterion(torch.tensor([tokens[-tail:] if tail else tokens]), None).any())
