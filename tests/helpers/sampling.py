"""Sharp tiny models over a 6-token vocabulary, whose exact continuation distribution under HF's sampling can be
enumerated: the reference of the generation-level sampling tests."""

import copy
import inspect
import itertools

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from helpers.models import llama

VOCAB, NEW = 6, 3  # vocabulary, new tokens per enumerated continuation


def peaky(seed, layers):
    """A Llama over VOCAB tokens whose outputs are sharp (random init gives near-uniform ones), without EOS."""
    model = llama(layers=layers, vocab=VOCAB, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    model.generation_config.eos_token_id = None
    return model


def hf_warpers(temperature, top_k, top_p):
    """HF's sampling warpers for these settings."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def continuation_probs(model, prompt, warpers):
    """Exact probability of every continuation of NEW tokens under HF's sampling, by enumeration.
    Returns (continuations [VOCAB**NEW, NEW], probabilities [VOCAB**NEW] as numpy)."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    ids = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = model(ids).logits.float()
    L = prompt.shape[1]
    logp = torch.zeros(len(seqs), dtype=torch.float64)
    for t in range(NEW):
        step = warpers(ids[:, : L + t], logits[:, L + t - 1].clone())
        logp += torch.log_softmax(step.double(), dim=-1).gather(1, seqs[:, t : t + 1]).squeeze(1)
    return seqs, logp.exp().numpy()


def _one_token_steps(model, source, source_mask, ids):
    """[rows, T, V] logits of an encoder-decoder ``model`` after each prefix of ``ids`` [rows, T] (decoder start
    first), one token per forward over a cache as generate runs it: a forward over the whole sequence numbers
    M2M100's pad tokens otherwise (by non-pad rank)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # (5.24 / older)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids=source, attention_mask=source_mask, return_dict=True)
        past, logits = None, []
        for t in range(ids.shape[1]):
            out = model(encoder_outputs=encoder_outputs, attention_mask=source_mask, decoder_input_ids=ids[:, t:t + 1],
                        use_cache=True, **{name: past})
            past = getattr(out, name)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def hf_chain_probs(model, prompt, mask, config, eos: int | None = None):
    """Exact probability of every NEW-token continuation of one prompt [1, L] (mask [1, L]: a decoder-only model's
    left-padded prompt, or an encoder-decoder model's right-padded source, whose decoder then starts from its
    decoder_start_token_id) under HF's own processor and warper chain for GenerationConfig ``config``
    (``_get_logits_processor``, as ``generate`` builds it for that row, lengths set as its
    ``_prepare_generated_length`` sets them). With ``eos``, a row is padded after its first EOS (with
    ``config.pad_token_id``): those continuations end there, and any other tail has probability 0.
    Returns numpy [VOCAB**NEW], in ``itertools.product`` order (the code of a continuation: its base-VOCAB number)."""
    config, _ = model._prepare_generation_config(copy.deepcopy(config))  # (the model's defaults where unset)
    model._prepare_special_tokens(config, True, device="cpu")
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    rows = len(seqs)  # (the chain runs on every continuation at once: its per-row inputs have that batch)
    source, source_mask = prompt.expand(rows, -1), mask.expand(rows, -1)
    if model.config.is_encoder_decoder:
        start = model.generation_config.decoder_start_token_id  # (else bos, as generate starts T5Gemma 2)
        start = torch.full((rows, 1), start if start is not None else model.generation_config.bos_token_id)
        ids = torch.cat([start, seqs], dim=1)
        logits = _one_token_steps(model, source, source_mask, ids)
        model_kwargs = {"attention_mask": source_mask}
    else:
        ids = torch.cat([source, seqs], dim=1)
        full_mask = torch.cat([source_mask, torch.ones_like(seqs)], dim=1)
        with torch.no_grad():
            logits = model(ids, attention_mask=full_mask, position_ids=(full_mask.cumsum(1) - 1).clamp(min=0)).logits
        model_kwargs = {"attention_mask": source_mask}
    width = ids.shape[1] - NEW  # the decoder's prompt: what HF's lengths count
    config.max_length = config.max_new_tokens + width
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + width
    logp = torch.zeros(rows, dtype=torch.float64)
    for t in range(NEW):
        ended = (seqs[:, :t] == eos).any(dim=1) if eos is not None else torch.zeros(rows, dtype=torch.bool)
        # HF's chain runs on the continuations still possible and running only: a prefix it can never generate
        # (every token banned after it) could make a warper fail (transformers 5.17's top-H on an all -inf row)
        alive = torch.nonzero((logp > float("-inf")) & ~ended).squeeze(1)
        term = torch.full((rows,), float("-inf"), dtype=torch.float64)  # (any other tail is impossible)
        term[ended & (seqs[:, t] == config.pad_token_id)] = 0.0  # after its EOS a row is padded: no more factors
        if len(alive):  # (when every continuation has ended or is impossible, a warper would fail on no rows)
            chain = model._get_logits_processor(generation_config=config, input_ids_seq_length=width,
                                                encoder_input_ids=source[alive], device="cpu",
                                                model_kwargs={k: v[alive] for k, v in model_kwargs.items()})
            step = chain(ids[alive, : width + t], logits[alive, width + t - 1].float().clone())
            term[alive] = torch.log_softmax(step.double(), dim=-1).gather(1, seqs[alive, t : t + 1]).squeeze(1)
        logp += term
    return logp.exp().numpy()
