"""Mamba2 mixers whose chunked scan clamps the SSM step size dt (``time_step_limit``) where their one-token step does
not (``capabilities._step_size_clamp_reason``): refused as a target by name, exact where the limit clamps nothing,
and, with the refusal bypassed, really different from model.generate (so the refusal is needed)."""

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, Zamba2Config, Zamba2ForCausalLM

import speculative_kernels as sk
from speculative_kernels.generation import capabilities
from helpers.models import perturbed

VOCAB = 97


def zamba2(bounded: bool, seed: int = 0):
    """A tiny Zamba2 (a Mamba2 layer, then a hybrid one with shared attention) whose logits read its SSM state:
    larger weights and the skip D zeroed, so that dt values under time_step_min change greedy tokens. bounded:
    False sets the mixers' time_step_limit to (0, inf), which clamps nothing (time_step_min=0 itself fails in
    Zamba2's weight initialisation: log(0))."""
    config = Zamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=8, mamba_headdim=8,
        chunk_size=4, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=8,
        num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=False, time_step_min=1e-3,
        initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = Zamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "D", None), torch.nn.Parameter):
                module.D.zero_()
            if not bounded and hasattr(module, "time_step_limit"):
                module.time_step_limit = (0.0, float("inf"))
    return model


def _prompt(seed: int):
    return torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(seed))


def _greedy(seed: int = 0) -> dict:
    return dict(attention_mask=torch.ones_like(_prompt(seed)), max_new_tokens=16, do_sample=False, pad_token_id=0,
                eos_token_id=None)


def test_a_bounded_step_size_is_refused_by_name():
    target = zamba2(bounded=True)  # Zamba2's default time_step_min, 0.001
    with pytest.raises(ValueError, match=r"Zamba2ForCausalLM.*time_step_limit=\(0\.001, inf\)"):
        sk.generate(target, _prompt(0), draft_model=perturbed(target, 0.3), **_greedy())
    mamba2 = Mamba2ForCausalLM(Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8,
                                            head_dim=8, state_size=8, expand=2, n_groups=1, chunk_size=4,
                                            time_step_limit=(0.0, 0.5))).eval()  # an upper bound
    with pytest.raises(ValueError, match=r"Mamba2ForCausalLM.*time_step_limit=\(0, 0\.5\)"):
        sk.generate(mamba2, _prompt(0), prompt_lookup_num_tokens=3, **_greedy())


@pytest.mark.parametrize("seed", range(3))
def test_an_unbounded_step_size_is_exact_and_a_bounded_draft_is_allowed(seed):
    target = zamba2(bounded=False, seed=seed)
    draft = zamba2(bounded=True, seed=seed + 10)  # a draft's forwards need not match model.generate's
    ids = _prompt(seed)
    expected = target.generate(ids, **_greedy(seed))
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, speculation_stats=stats,
                      **_greedy(seed))
    assert torch.equal(got, expected)
    assert stats.accepted_tokens < stats.drafted_tokens  # rejections: the rollback ran


def test_bypassing_the_refusal_gives_other_logits_than_model_generate(monkeypatch):
    """What the refusal prevents, under the installed transformers: with it bypassed, the logits of the emitted
    tokens differ from model.generate's far beyond float error (measured here: 5.5e-2 of the largest logit, 5.17 and
    5.24; steps and the scan agree to ~1e-6 where dt is inside the limit), on some of the prompts."""
    monkeypatch.setattr(capabilities, "_step_size_clamp_reason", lambda model: None)
    largest = 0.0
    for seed in range(6):
        target = zamba2(bounded=True, seed=seed)
        ids = _prompt(seed)
        options = dict(_greedy(seed), return_dict_in_generate=True, output_logits=True)
        expected = target.generate(ids, **options)
        got = sk.generate(target, ids, draft_model=perturbed(target, 0.3), num_speculative_tokens=3, **options)
        for ours, theirs, token, their_token in zip(got.logits, expected.logits, got.sequences[0, 8:],
                                                     expected.sequences[0, 8:]):
            largest = max(largest, ((ours - theirs).abs().max() / theirs.abs().max()).item())
            if token != their_token:
                break
        if largest > 1e-3:
            break
    assert largest > 1e-3
