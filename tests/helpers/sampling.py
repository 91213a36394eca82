"""Sharp tiny models over a 6-token vocabulary, whose exact continuation distribution under HF's sampling can be
enumerated: the reference of the generation-level sampling tests."""

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
