"""Checking a call's inputs once, for decoder-only and encoder-decoder models alike: the models, the token tensors
and masks, the helpers, what a batch can take; and the decoder-only prompt."""

import torch

from .capabilities import check_class, check_pair
from .options import BatchingOptions
from .settings import Plan
from .vocab import check_ids_in_vocabulary


def model_device(model, name: str = "model") -> torch.device:
    """Where the model runs: its first parameter's device or, where accelerate offloaded that parameter (it is on the
    meta device, loaded by a hook for each forward), the device the hooks run the model on."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        raise ValueError(f"{name} has no parameters") from None
    if device.type != "meta":
        return device
    for module in model.modules():
        execution = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if execution is not None:
            return torch.device(execution)
    raise ValueError(f"{name} has parameters on the meta device (weights not loaded, and no accelerate offloading "
                     "hook to load them); load its weights")


def check_models(model, draft_model, names: tuple[str, str] = ("model", "draft_model"),
                 early_exit: bool = False) -> None:
    """Two HF models on one device, both decoder-only or both encoder-decoders of a supported type (or the target
    alone: draft_model None, for drafting without a model; ``request.build_loop`` checks that something drafts).
    names: the arguments' names in the errors (``SpeculativeDecoder``'s are target and draft). early_exit: the
    target's first layers will draft (a forward compiled on the instance is refused then: not suggested)."""
    for name, m in zip(names, (model, draft_model)):
        if m is None and name == names[1]:
            break
        inner = getattr(m, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module) and type(m).__name__ == "OptimizedModule":
            forward = "" if early_exit else f" (or compile its forward: {name}.forward = torch.compile({name}.forward))"
            raise TypeError(f"{name} is a torch.compile wrapper (OptimizedModule) of {type(inner).__name__}; pass the "
                            f"model itself ({name}._orig_mod) and compile=True to capture the decoding steps{forward}")
        if not hasattr(m, "generation_config") or not callable(getattr(m, "forward", None)):
            raise TypeError(f"{name} must be a Hugging Face model that generates (a PreTrainedModel with a "
                            f"generation_config: ...ForCausalLM, ...ForConditionalGeneration), got {type(m).__name__}")
        check_class(m, name)  # (a class with a generation loop of its own, before anything touches its modules)
    for name, m in zip(names, (model, draft_model)):
        if m is not None and getattr(m, "dtype", None) == torch.float64:
            raise ValueError(f"{name} is float64: the verification takes float32, float16 or bfloat16 logits (as "
                             f"the kernels do); use {name}.float()")
    if draft_model is None:
        return
    check_pair(model, draft_model)
    target_device, draft_device = model_device(model, names[0]), model_device(draft_model, names[1])
    if target_device != draft_device:
        raise ValueError(f"{names[0]} is on {target_device} but {names[1]} is on {draft_device}; put both on one "
                         "device")


def check_helpers(tokenizer, assistant_tokenizer, batching) -> None:
    for name, value in (("tokenizer", tokenizer), ("assistant_tokenizer", assistant_tokenizer)):
        if value is not None and not callable(getattr(value, "get_vocab", None)):
            raise TypeError(f"{name} must be a transformers tokenizer (with get_vocab()), got {type(value).__name__}")
    if batching is not None and not isinstance(batching, BatchingOptions):
        raise TypeError(f"batching must be a speculative_kernels BatchingOptions, got {type(batching).__name__}")


def check_token_type(name: str, ids) -> None:
    """TypeError unless ``ids`` is None or a tensor (a list of lists is the usual mistake)."""
    if ids is not None and not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids [batch, length], got {type(ids).__name__}")
    if ids is not None and ids.dim() >= 2 and ids.shape[0] == 0:  # (a [B, 0] prompt starts from BOS; 0 rows: none)
        raise ValueError(f"{name} has no rows (shape {tuple(ids.shape)}): pass at least one prompt")


def token_tensor(name: str, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """ids [B, L] of an integer dtype, as int64 on ``device`` (ValueError / TypeError naming ``name``)."""
    check_token_type(name, ids)
    if ids.dim() != 2:
        raise ValueError(f"{name} must be a [batch, length] tensor, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer tensor, got {ids.dtype}")
    return ids.to(device=device, dtype=torch.int64)


def mask_tensor(name: str, mask, shape, device: torch.device, of: str = "input_ids") -> torch.Tensor:
    """An attention mask of ``shape`` (that of ``of``) of 0/1 values on ``device``: bool or integer as given, floating
    point (what ``torch.ones`` makes, which ``model.generate`` takes) as int64 (TypeError / ValueError naming
    ``name``). Other values are refused: transformers reads a mask both as != 0 (attention) and, truncated to
    integers, as counts (its position ids: ``cumsum``), which agree for 0 and 1 alone (GPT-2 with a -1 in its mask
    generated other tokens than with a 1)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of 0/1 values, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but {of} has {tuple(shape)}")
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool, integer or floating-point tensor of 0/1 values, got {mask.dtype}")
    if mask.dtype != torch.bool:
        outside = ~((mask == 0) | (mask == 1))
        if bool(outside.any()):
            value = mask[outside][0].item()
            raise ValueError(f"{name} must hold only 0 and 1, got {value} (transformers reads other values one way "
                             "for attention and another for positions)")
        if mask.is_floating_point():
            mask = mask.to(torch.int64)
    return mask.to(device)


def prompt_length(input_ids) -> int:
    """The width of a decoder-only prompt as given (an empty or missing prompt becomes one BOS token)."""
    return max(0 if input_ids is None or input_ids.dim() < 2 else input_ids.shape[1], 1)


def inferred_attention_mask(input_ids, pad_token_id: int | None, eos_token_ids) -> torch.Tensor | None:
    """HF's ``_prepare_attention_mask_for_generation``: with no attention_mask given, a pad_token_id that is not one
    of the EOS ids and occurs in input_ids [B, L] marks padding, mask = (input_ids != pad_token_id) as int64 [B, L].
    Returns None where HF's mask is all ones (no pad id, pad id among the EOS ids, no pad token in the input)."""
    if pad_token_id is None or pad_token_id in tuple(eos_token_ids or ()):
        return None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32,
                                                                                                  torch.int64):
        return None  # as HF: only integer [B, L] ids carry padding
    mask = input_ids != pad_token_id
    if bool(mask.all()):
        return None
    return mask.long()


def bos_id(bos_token_id) -> int:
    """The BOS id a prompt starts from: one id (an int, or a one-element tensor as HF takes it); a list or tuple is a
    TypeError naming it (model.generate fails on it inside transformers; with a prompt given, it only keeps it)."""
    if isinstance(bos_token_id, (list, tuple)):
        raise TypeError(f"bos_token_id must be one token id (an int) to start a prompt from, got {bos_token_id!r}")
    return int(bos_token_id)


def prepare_prompt(model, input_ids, attention_mask, bos_token_id,
                   inferred_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder-only prompt: (input_ids [B, L] int64, attention_mask [B, L]) on the model's device, left-padded,
    every row with a real token and every id in the vocabulary. An empty or missing prompt starts from BOS.
    inferred_from: the pad_token_id attention_mask was inferred from (``inferred_attention_mask``), for errors."""
    device = model_device(model)
    if input_ids is None or input_ids.numel() == 0:
        if bos_token_id is None:
            raise ValueError("input_ids is empty and the model has no bos_token_id to start from")
        batch = 1 if input_ids is None or input_ids.dim() < 2 else max(input_ids.shape[0], 1)
        if input_ids is None and attention_mask is not None:  # HF takes the batch size from the mask
            batch = _bos_batch(attention_mask)
        input_ids = torch.full((batch, 1), bos_id(bos_token_id), dtype=torch.int64, device=device)
        attention_mask = None
    input_ids = token_tensor("input_ids", input_ids, device)
    check_ids_in_vocabulary(model, "input_ids", input_ids)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = mask_tensor("attention_mask", attention_mask, input_ids.shape, device)
    real = attention_mask != 0
    empty = (~real.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask is all zeros in batch rows {empty}: every prompt needs at least one real "
                         "token (pass the row's BOS token to start from nothing)")
    if not bool(real[:, -1].all()):
        if inferred_from is not None:
            rows = (~real[:, -1]).nonzero().flatten().tolist()
            raise ValueError(f"input_ids ends with pad_token_id={inferred_from} in batch rows {rows} and no "
                             "attention_mask was given: as in transformers, the mask is inferred from pad_token_id, "
                             "which makes those rows right-padded; pass attention_mask (left padding) or another "
                             "pad_token_id")
        raise ValueError("attention_mask shows right padding; decoder-only generation needs left padding")
    return input_ids, attention_mask


def _bos_batch(attention_mask) -> int:
    """No input_ids but an attention_mask: HF's ``_maybe_initialize_input_ids_for_generation`` starts one BOS per
    row of the mask (its batch size) and keeps the mask, which fits a [B, 1] mask of ones only; anything else is
    refused by name."""
    if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[1] != 1
            or attention_mask.shape[0] == 0
            or not bool((attention_mask != 0).all())):
        raise ValueError(f"attention_mask without input_ids must be [batch, 1] ones (one BOS token per row, as in "
                         f"transformers), got {getattr(attention_mask, 'shape', attention_mask)}; pass input_ids")
    return attention_mask.shape[0]


def check_batch(plan: Plan, batch: int, rows=None) -> None:
    """What needs batch size 1 (as in transformers), and what a batch needs. rows: the per-row settings of a batch
    of separate requests (``RowSettings``), or None."""
    if batch > 1 and plan.streamer is not None:
        raise ValueError("streamer supports batch size 1 only (as in transformers); for text per row of a batch, "
                         "step a SpeculativeDecoder session and give each row an IncrementalDetokenizer")
    if batch > 1 and plan.stopping_criteria:
        raise ValueError("stopping_criteria are supported for batch size 1 only")
    # Without pad_token_id there is no EOS either (pad falls back to eos_token_id): every row of one call runs to
    # max_new_tokens, none is padded, and HF generates such a batch. Separate requests end at their own lengths.
    if batch > 1 and plan.pad_token_id is None and rows is not None:
        raise ValueError("batch > 1 needs pad_token_id (or eos_token_id) to pad finished rows")


def repeat_rows(value, copies: int):
    """HF's ``_expand_inputs_for_generation``: every row of value repeated ``copies`` times, each prompt's copies
    together (tensors [B, ...] -> [B * copies, ...]; a ModelOutput, dict or tuple of them element-wise; None and
    anything else as given)."""
    if isinstance(value, torch.Tensor):
        return value.repeat_interleave(copies, dim=0)
    if isinstance(value, dict):  # (a ModelOutput is one)
        repeated = {name: repeat_rows(item, copies) for name, item in value.items()}
        return type(value)(**repeated) if type(value) is not dict else repeated
    if isinstance(value, tuple):
        return tuple(repeat_rows(item, copies) for item in value)
    return value
