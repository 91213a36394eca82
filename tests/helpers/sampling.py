"""Sharp tiny models over a 6-token vocabulary, whose exact continuation distribution under HF's sampling can be
enumerated: the reference of the generation-level sampling tests."""

import copy
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


def hf_chain_probs(model, prompt, mask, config, eos: int | None = None):
    """Exact probability of every NEW-token continuation of one (left-padded) prompt [1, L] (mask [1, L]) under HF's
    own processor and warper chain for GenerationConfig ``config`` (``_get_logits_processor``, as ``generate``
    builds it for that row, lengths set as its ``_prepare_generated_length`` sets them). With ``eos``, a row is
    padded (token 0) after its first EOS: those continuations end there, and any other tail has probability 0.
    Returns numpy [VOCAB**NEW], in ``itertools.product`` order (the code of a continuation: its base-VOCAB number)."""
    config = copy.deepcopy(config)
    model._prepare_special_tokens(config, True, device="cpu")
    width = prompt.shape[1]
    config.max_length = config.max_new_tokens + width
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + width
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    rows = len(seqs)  # (the chain runs on every continuation at once: its per-row inputs have that batch)
    chain = model._get_logits_processor(generation_config=config, input_ids_seq_length=width,
                                        encoder_input_ids=prompt.expand(rows, -1), device="cpu",
                                        model_kwargs={"attention_mask": mask.expand(rows, -1)})
    ids = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    full_mask = torch.cat([mask.expand(len(seqs), -1), torch.ones_like(seqs)], dim=1)
    with torch.no_grad():
        logits = model(ids, attention_mask=full_mask, position_ids=(full_mask.cumsum(1) - 1).clamp(min=0)).logits
    logp = torch.zeros(len(seqs), dtype=torch.float64)
    for t in range(NEW):
        step = chain(ids[:, : width + t], logits[:, width + t - 1].float().clone())
        term = torch.log_softmax(step.double(), dim=-1).gather(1, seqs[:, t : t + 1]).squeeze(1)
        if eos is not None:
            ended = (seqs[:, :t] == eos).any(dim=1)
            term = torch.where(ended, torch.where(seqs[:, t] == 0, 0.0, float("-inf")).double(), term)
        logp += term
    return logp.exp().numpy()
