"""Forward hooks on the target (``hooks.py``: ``per_token_hook``, ``unmarked_hooks``, the known per-token hooks):
the cases test_hooks.py leaves open, each failing on the old code or on a mutant of those checks that it let through
(mutation round 6)."""

import pytest
import torch
from helpers.models import llama, perturbed

import speculative_kernels as sk

KWARGS = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
IDS = torch.tensor([[5, 17, 42, 70, 7]])


def test_neftune_in_training_mode_is_refused():
    """NEFTune's hook (activate_neftune; the Trainer's neftune_noise_alpha) is known per-token, but in training mode
    it adds uniform noise to the embeddings at every forward: a target in training mode without dropout (Llama's
    default) and NEFTune active was accepted, every forward random (other tokens than model.generate), silently.
    Refused naming it; in eval mode (the hook returns the embeddings unchanged) it is exact."""
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    target = llama()
    handle = activate_neftune(target, 5.0)
    target.train()
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is in training mode with training-mode randomness active "
                                         r"\(model.embed_tokens: NEFTune noise, neftune_noise_alpha=5.0\).*"
                                         r"model.eval\(\)"):
        sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS)
    target.eval()
    expected = target.generate(IDS, **KWARGS)
    assert torch.equal(sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS),
                       expected)
    deactivate_neftune(target, handle)
    target.train()  # without NEFTune (and no dropout) training mode is deterministic: accepted
    assert torch.equal(sk.generate(target, IDS, draft_model=perturbed(target), num_speculative_tokens=3, **KWARGS),
                       expected)
