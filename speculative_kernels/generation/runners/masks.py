"""The attention masks the runners give the models, built in one place from which slots each row attends to.

HF's sdpa/eager attention takes an additive 4-D mask [B, 1, T, S] as given, so a row with holes computes exactly what
it would compute alone and HF never reads a 2-D mask on the host to decide whether it may skip masking.
"""

import itertools

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as mask_functions

from ..capabilities import ModelSpec
from ..wrapped_seq2seq import is_wrapper


def attention_dtype(model) -> torch.dtype:
    """The dtype the model's attention computes in, for its additive masks: that of the first floating parameter of
    its (text) decoder outside the input embedding (a model may keep its embedding in another dtype, e.g. bfloat16
    to save memory beside float32 layers: a mask in the embedding's dtype fails inside SDPA, or is mishandled by it;
    a vision-language model's vision tower, which comes first, may have a dtype of its own)."""
    embedding = _quiet(getattr(model, "get_input_embeddings", None))
    skip = set() if embedding is None else {id(p) for p in embedding.parameters()}
    decoder = _quiet(getattr(model, "get_decoder", None))
    first = None
    parameters = model.parameters()
    if isinstance(decoder, torch.nn.Module):  # (then the whole model's, should the decoder hold none)
        parameters = itertools.chain(decoder.parameters(), parameters)
    for parameter in parameters:
        if not parameter.is_floating_point():
            continue
        if id(parameter) not in skip:
            return parameter.dtype
        first = first or parameter.dtype
    return first if first is not None else torch.get_default_dtype()


def _quiet(getter):
    """getter() or None where there is none or it raises (transformers' auto-handled getters raise
    NotImplementedError on classes they cannot map)."""
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed [B, T, S] bool (query t may see slot s) -> the additive mask [B, 1, T, S]: 0 or dtype's minimum."""
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, blocked).unsqueeze(1)


def cross_attention_mask(model, encoder_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """encoder_mask [B, S] (nonzero = a real source token) -> the cross-attention mask [B, 1, 1, S], broadcast over
    queries, in the form transformers' own mask function for the model's attention builds it: bool for sdpa's (a row
    with no real source token then attends to nothing: SDPA returns 0 for it, as in model.generate), additive
    otherwise (eager: such a row averages every source state, as in model.generate)."""
    allowed = encoder_mask.to(torch.bool)[:, None, None, :]
    # (a generic wrapper's decoder builds it: its own config says which attention it runs)
    attention = getattr(model.config.decoder if is_wrapper(model) else model.config, "_attn_implementation", None)
    if attention in mask_functions and mask_functions[attention] is mask_functions.get("sdpa"):
        return allowed
    return additive_mask(allowed[:, :, 0], dtype)


def causal_slots(attend: torch.Tensor, query_slots: torch.Tensor) -> torch.Tensor:
    """[B, T, S] bool: the query at slot q sees slot s iff s <= q and attend[b, s]. attend: [B, S] (nonzero =
    attended); query_slots: [T] (every row's queries at the same slots) or [B, T] (a slot per row and query)."""
    keys = torch.arange(attend.shape[1], device=attend.device)
    causal = keys <= query_slots.unsqueeze(-1)  # [T, S] or [B, T, S]
    return causal & attend.unsqueeze(1).bool()


def window_mask(slot_mask: torch.Tensor, query_slots: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T, S] bool: the key at slot s is inside the sliding window of the query at slot query_slots[t].

    slot_mask: [B, S] (1 = real slot); query_slots: [T]. Real slots of a row carry positions 0, 1, 2, ... in slot
    order (holes take none), so a slot's position is the count of real slots up to it, minus one; HF's rule is
    q - k < window over positions (cache positions in HF, which differ from these by the row's left padding only).
    """
    positions = slot_mask.cumsum(dim=1)  # [B, S]: position + 1 at real slots
    query = positions.index_select(1, query_slots)  # [B, T]
    return positions.unsqueeze(1) > (query - window).unsqueeze(2)  # q - k < window, with no [B, T, S] int64


def decoder_mask(slot_mask: torch.Tensor, query_slots: torch.Tensor, spec: ModelSpec, dtype: torch.dtype):
    """The ``attention_mask`` of a decoder-only forward whose queries sit at ``query_slots`` [T] of slot_mask [B, S]:
    the slot mask itself for "2d" models (ALiBi from the mask; attention that takes no 4-D mask), else the additive
    4-D mask, with the sliding window applied over real positions, or a dict of both keyed by layer type."""
    if spec.mask == "2d":
        return slot_mask
    allowed = causal_slots(slot_mask, query_slots)
    if spec.sliding_window is None:
        return additive_mask(allowed, dtype)
    sliding = additive_mask(allowed & window_mask(slot_mask, query_slots, spec.sliding_window), dtype)
    if spec.mask == "4d-by-layer-type":
        return {"full_attention": additive_mask(allowed, dtype), "sliding_attention": sliding}
    return sliding
