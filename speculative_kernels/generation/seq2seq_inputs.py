"""Preparing an encoder-decoder request as HF's ``generate`` does: the encoder input, the decoder prompt, and the
encoder passes (run once per request, after every check)."""

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable

import torch
from transformers.modeling_outputs import BaseModelOutput

from .capabilities import POSITION_KINDS, position_kind
from .runners.seq2seq import same_output_class
from .inputs import bos_id, mask_tensor, model_device, token_tensor
from .vocab import check_ids_in_vocabulary
from .wrapped_seq2seq import decoder_pad_id, encoder_input_name, feature_tensor, is_wrapper, passes_input_mask


@dataclasses.dataclass
class Seq2SeqPrompt:
    """decoder_ids, decoder_mask: [B, Ld], the decoder prompt (start token first); encoder_mask: [B, S] or None;
    encode(): runs the encoders, returning {id(model): BaseModelOutput with last_hidden_state [B, S, H]}."""

    decoder_ids: torch.Tensor
    decoder_mask: torch.Tensor
    encoder_mask: torch.Tensor | None
    encode: Callable[[], dict]


def prepare_seq2seq(model, draft_model, input_ids, attention_mask, config, *, decoder_input_ids=None,
                    decoder_attention_mask=None, encoder_outputs=None) -> Seq2SeqPrompt:
    """input_ids, attention_mask: the encoder input [B, S] (either may be None, as in HF; right padding as usual);
    config: the resolved GenerationConfig (decoder_start_token_id, bos_token_id). ``decoder_input_ids`` (with
    ``decoder_attention_mask``) continue the decoder prompt; ``encoder_outputs`` replace the target's encoder pass."""
    device = model_device(model)
    encoder_outputs = _as_encoder_output(encoder_outputs, device)
    _check_encoder_output_fields(model, encoder_outputs)
    name = encoder_input_name(model)
    if name == "input_ids":
        input_ids, attention_mask = _encoder_input(input_ids, attention_mask, encoder_outputs, config.bos_token_id,
                                                   device, (decoder_input_ids, decoder_attention_mask))
    else:  # a vision or speech wrapper's features
        input_ids, attention_mask = _encoder_features(model, name, input_ids, attention_mask, encoder_outputs, device)
    batch = input_ids.shape[0] if input_ids is not None else encoder_outputs.last_hidden_state.shape[0]
    decoder_ids, decoder_mask = _decoder_prompt(config, decoder_input_ids, decoder_attention_mask, batch, device)
    if input_ids is not None and name == "input_ids":
        check_ids_in_vocabulary(model.get_encoder(), "input_ids", input_ids)
    check_ids_in_vocabulary(_decoder_embedding_owner(model), "decoder_input_ids", decoder_ids)
    for name, m in (("model", model), ("draft_model", draft_model)):
        if m is not None:  # (no draft model: prompt lookup, n-grams, early exit)
            _check_pads_numbered_as_in_steps(m, name, decoder_ids)
            _check_prompt_forward_is_causal(m, name, decoder_ids)
    encode = functools.partial(_encode_both, model, draft_model, input_ids, attention_mask, encoder_outputs)
    return Seq2SeqPrompt(decoder_ids, decoder_mask, attention_mask, encode)


def _check_pads_numbered_as_in_steps(model, name: str, decoder_ids: torch.Tensor) -> None:
    """ValueError where a decoder prompt [B, L] has the pad token before a non-pad token and ``model`` numbers its
    positions from its ids (M2M100/NLLB, ``capabilities.POSITION_KINDS``): its prompt forward then numbers the later
    tokens by their non-pad rank where its one-token steps (and the runners, after rollbacks) number them by
    position. One host read, before decoding."""
    if is_wrapper(model):
        if position_kind(model, name) not in ("absolute_skipping_pads", "position_ids_skipping_pads"):
            return
        pad = decoder_pad_id(model)  # (RoBERTa's embeddings, TrOCR's sinusoids)
    elif POSITION_KINDS.get(getattr(model.config, "model_type", None)) != "absolute_skipping_pads":
        return
    else:
        pad = model.get_decoder().embed_positions.padding_idx
    pads = decoder_ids == pad
    if bool((pads.to(torch.int64).cumsum(dim=1).bool() & ~pads).any()):
        raise ValueError(f"decoder_input_ids has the pad token ({pad}) before another token: {name} "
                         f"({type(model).__name__}) numbers its decoder positions from its token ids, skipping pad "
                         "tokens in its first forward only, which speculative_kernels does not reproduce; fill the "
                         "slots that decoder_attention_mask masks with another token (e.g. eos)")


def _decoder_embedding_owner(model):
    """What embeds the decoder's ids: a wrapper's decoder (its get_input_embeddings is its encoder's: bert2gpt2's
    decoder ids run past BERT's vocabulary); the decoder stack where it has its own token embedding (FSMT's target
    vocabulary differs from its source one, which model.get_input_embeddings returns); else the model."""
    decoder = model.get_decoder()
    if is_wrapper(model):
        return decoder
    return decoder if isinstance(getattr(decoder, "embed_tokens", None), torch.nn.Embedding) else model


def _check_prompt_forward_is_causal(model, name: str, decoder_ids: torch.Tensor) -> None:
    """ValueError where a decoder prompt [B, L] has more than one token and ``model.generate``'s first forward runs it
    without a causal mask (``_non_causal_prompt_reason``): each prompt token then attends to the later ones, which
    the runners' causal forwards do not reproduce (one-token steps are causal whatever the mask)."""
    reason = _non_causal_prompt_reason(model)
    if reason is None or decoder_ids.shape[1] == 1:
        return
    raise ValueError(f"decoder_input_ids gives a decoder prompt of {decoder_ids.shape[1]} tokens (start token "
                     f"included): {name} ({type(model).__name__})'s model.generate runs it without a causal mask ("
                     f"{reason}; each prompt token attends to the later ones), which speculative_kernels does not "
                     "reproduce; start from decoder_start_token_id alone")


def _non_causal_prompt_reason(model) -> str | None:
    """Why ``model.generate`` runs a decoder prompt of several tokens without a causal mask, or None. FSMT: its
    forward under use_cache passes its decoder none (transformers 5.17 also keeps only the last token). UMT5 where its
    decoder self-attention is built with ``is_causal=False`` (transformers 5.17; 5.24 builds it causal): its decoder,
    given no decoder_attention_mask, masks nothing."""
    if POSITION_KINDS.get(getattr(model.config, "model_type", None)) == "absolute_fsmt":
        return "FSMT's forward under use_cache passes its decoder no causal mask"
    if getattr(model.config, "model_type", None) == "umt5":
        attention = model.get_decoder().block[0].layer[0].SelfAttention
        if getattr(attention, "is_causal", True) is False:
            return "this transformers builds UMT5's decoder self-attention with is_causal=False"
    return None


@functools.lru_cache(maxsize=None)
def _encoder_fields_read(model_class) -> tuple[str, ...]:
    """The ``encoder_outputs.<field>`` names ``model_class.forward``'s source reads (() where it has none)."""
    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return ()
    return tuple(sorted(set(re.findall(r"encoder_outputs\.(\w+)", source))))


def _check_encoder_output_fields(model, encoder_outputs) -> None:
    """TypeError where the given ``encoder_outputs`` (a tuple is taken as a BaseModelOutput) lack a field the
    model's forward reads: Switch Transformers reads ``encoder_outputs.router_logits``, so a BaseModelOutput or a
    tuple failed inside transformers with an AttributeError (model.generate fails alike)."""
    if encoder_outputs is None:
        return
    missing = [f for f in _encoder_fields_read(type(model)) if not hasattr(encoder_outputs, f)]
    if missing:
        raise TypeError(f"encoder_outputs ({type(encoder_outputs).__name__}) has no {', '.join(missing)}, which "
                        f"{type(model).__name__}'s forward reads; pass its encoder's own output (model.get_encoder()"
                        "(input_ids=..., attention_mask=..., return_dict=True))")


def _as_encoder_output(encoder_outputs, device):
    if encoder_outputs is None:
        return None
    if isinstance(encoder_outputs, (tuple, list)):
        encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs[0])
    hidden = getattr(encoder_outputs, "last_hidden_state", None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError("encoder_outputs must hold last_hidden_state [batch, source length, hidden]")
    return same_output_class(encoder_outputs, hidden.to(device))


def _encoder_input(input_ids, attention_mask, encoder_outputs, bos_token_id, device, decoder_inputs=(None, None)):
    """(input_ids, attention_mask) for the encoders. No ids and no encoder_outputs: one bos per row, as HF does
    (``_maybe_initialize_input_ids_for_generation``: as many rows as the attention_mask or the decoder_inputs
    (decoder_input_ids, decoder_attention_mask) given have, else one)."""
    if input_ids is None and encoder_outputs is None:
        if bos_token_id is None:
            raise ValueError("input_ids (or encoder_outputs) is required: the model has no bos_token_id to start from")
        given = next((t for t in (attention_mask, *decoder_inputs) if isinstance(t, torch.Tensor) and t.dim() > 0),
                     None)
        batch = 1 if given is None else given.shape[0]
        input_ids = torch.full((batch, 1), bos_id(bos_token_id), dtype=torch.int64, device=device)
    if input_ids is not None:
        input_ids = token_tensor("input_ids", input_ids, device)
        if input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a [batch, length] tensor, got shape {tuple(input_ids.shape)}")
    given = encoder_outputs is not None and input_ids is not None
    if given and encoder_outputs.last_hidden_state.shape[0] != input_ids.shape[0]:
        raise ValueError("encoder_outputs and input_ids have different batch sizes")
    if attention_mask is not None:
        source = input_ids.shape if input_ids is not None else encoder_outputs.last_hidden_state.shape[:2]
        attention_mask = mask_tensor("attention_mask", attention_mask, source, device, of="the encoder input")
    return input_ids, attention_mask


def _encoder_features(model, name: str, values, attention_mask, encoder_outputs, device):
    """(values, attention_mask) for a vision or speech wrapper's encoder: ``name`` (``pixel_values``,
    ``input_values``, ``input_features``) [B, ...] floating point, required unless encoder_outputs are given. A
    speech wrapper takes the input's mask [B, L] (its forward turns it into the cross-attention mask; without one,
    model.generate passes ones, as here); a vision wrapper's forward takes none, so one given is refused rather than
    ignored."""
    if values is None and encoder_outputs is None:
        raise ValueError(f"{name} (or encoder_outputs) is required: {type(model).__name__}'s encoder reads {name}")
    if values is not None:
        values = feature_tensor(name, values, device)
        if encoder_outputs is not None and encoder_outputs.last_hidden_state.shape[0] != values.shape[0]:
            raise ValueError(f"encoder_outputs and {name} have different batch sizes")
    if not passes_input_mask(model):
        if attention_mask is not None:
            raise ValueError(f"attention_mask is not taken by {type(model).__name__} (its forward has none: "
                             "model.generate ignores it); leave it out")
        return values, None
    if values is None:
        if attention_mask is not None:
            raise ValueError(f"attention_mask with encoder_outputs alone: {type(model).__name__} derives its "
                             f"cross-attention mask from the mask over {name}, whose length it needs; pass {name}")
        return None, None
    if attention_mask is None:  # (model.generate's _prepare_attention_mask_for_generation for a float input)
        attention_mask = torch.ones(values.shape[:2], dtype=torch.int64, device=device)
    return values, mask_tensor("attention_mask", attention_mask, values.shape[:2], device, of=name)


def _decoder_prompt(config, decoder_ids, decoder_mask, batch: int, device):
    """HF's decoder prompt: decoder_start_token_id (or bos) alone, or prepended to decoder_input_ids that do not
    all start with it (decoder_attention_mask gets a 1 in front)."""
    start = config.decoder_start_token_id if config.decoder_start_token_id is not None else config.bos_token_id
    if start is None:
        raise ValueError("decoder_start_token_id or bos_token_id has to be defined for encoder-decoder generation")
    start = torch.as_tensor(start, dtype=torch.int64, device=device)
    if start.dim() == 1 and start.shape[0] != batch:
        raise ValueError(f"decoder_start_token_id has {start.shape[0]} entries for a batch of {batch}")
    start = start.view(-1, 1).expand(batch, 1)
    if decoder_ids is None:  # the start token; a decoder_attention_mask given alone is its mask, as in HF ([B, 1])
        if decoder_mask is None:
            return start.clone(), torch.ones(batch, 1, dtype=torch.int64, device=device)
        decoder_mask = mask_tensor("decoder_attention_mask", decoder_mask, (batch, 1), device,
                                   of="the decoder's start token").to(torch.int64)
        if not bool(decoder_mask.all()):
            raise ValueError("decoder_attention_mask given without decoder_input_ids masks the decoder's start token, "
                             "its only token: the decoder would have nothing to attend to")
        return start.clone(), decoder_mask
    if not isinstance(decoder_ids, torch.Tensor) or decoder_ids.dim() != 2 or decoder_ids.shape[0] != batch:
        raise ValueError(f"decoder_input_ids must be a [{batch}, length] tensor, got "
                         f"{getattr(decoder_ids, 'shape', decoder_ids)}")
    decoder_ids = token_tensor("decoder_input_ids", decoder_ids, device)  # (floats were truncated to ids)
    if decoder_mask is None:
        decoder_mask = torch.ones_like(decoder_ids)
    decoder_mask = mask_tensor("decoder_attention_mask", decoder_mask, decoder_ids.shape, device,
                               of="decoder_input_ids").to(torch.int64)
    if decoder_ids.shape[1] == 0 or bool((decoder_ids[:, 0] != start[:, 0]).all()):
        decoder_ids = torch.cat([start, decoder_ids], dim=1)
        decoder_mask = torch.cat([torch.ones_like(start), decoder_mask], dim=1)
    if not bool(decoder_mask[:, -1].all()):
        raise ValueError("decoder_attention_mask must be 1 at the last decoder_input_ids position of every row")
    return decoder_ids, decoder_mask


@torch.inference_mode()
def _encode_both(model, draft_model, input_ids, attention_mask, encoder_outputs) -> dict:
    """id(model) -> encoder output. The draft reuses the target's when it is the same model or shares its encoder."""
    if encoder_outputs is None:
        encoder_outputs = _run_encoder(model, input_ids, attention_mask)
    encoded = {id(model): encoder_outputs}
    if draft_model is None:  # drafting without a model
        return encoded
    if draft_model is model or draft_model.get_encoder() is model.get_encoder():
        encoded[id(draft_model)] = encoder_outputs
    elif input_ids is None:
        raise ValueError("encoder_outputs alone cannot feed the draft's own encoder; pass input_ids as well")
    else:
        encoded[id(draft_model)] = _run_encoder(draft_model, input_ids, attention_mask)
    return encoded


def _run_encoder(model, inputs: torch.Tensor, attention_mask):
    """The encoder's output on inputs (token ids [B, S], or a wrapper's pixel_values / input_values /
    input_features) with attention_mask [B, S] (left out where None: a vision encoder takes none)."""
    masks = {} if attention_mask is None and encoder_input_name(model) != "input_ids" else {
        "attention_mask": attention_mask}
    return model.get_encoder()(**{encoder_input_name(model): inputs}, **masks, return_dict=True)
