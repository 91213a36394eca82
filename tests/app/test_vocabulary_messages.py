"""The words of generate's vocabulary refusal (the command's own refusal, in its terms, is in test_cli.py)."""

import copy
import re

import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama


def test_a_refusal_for_different_logit_widths_names_them():
    """A draft whose lm_head is wider than its config.vocab_size (a head replaced without the config): the refusal
    names the widths it compared as well as the config sizes (it read "vocab_size 97 vs 97")."""
    target, draft = llama(layers=2, seed=0), llama(layers=1, seed=4)
    wide = copy.deepcopy(draft)
    head = torch.nn.Linear(32, 128, bias=False)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[:97] = draft.lm_head.weight
    wide.lm_head, wide.config.tie_word_embeddings = head, False
    assert wide.config.vocab_size == target.config.vocab_size == 97
    message = ("the draft's logits are 128 wide (config vocab_size 97), the target's 97 (config vocab_size 97); if "
               "they share a tokenizer")
    with pytest.raises(ValueError, match=re.escape("different vocabularies: " + message)):
        sk.generate(target, torch.tensor([[5, 17, 42, 70, 7]]), draft_model=wide, max_new_tokens=4, do_sample=False)
