"""Rotary embeddings whose frequencies follow the forward's longest position (transformers' ``dynamic_rope_update``:
"dynamic" NTK scaling, "longrope" as in Phi-3/3.5/4-mini).

Up to the limit (``original_max_seq_len`` / ``original_max_position_embeddings``) every forward uses the same
frequencies and speculative decoding is exact; past it a verification forward, which reaches positions a one-token
step of ``model.generate`` has not yet, would use other frequencies than HF's step at the same token: different
logits (by 5e-5 to 1e-3 on these tiny models, against 1e-7 of rounding), different tokens. A request that can reach
past the limit is refused by name, on every path, before anything runs.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

import speculative_kernels as sk
from speculative_kernels.generation.capabilities import position_dependent_rope
from helpers.models import SPECIAL, VOCAB, perturbed
from helpers.prompts import left_padded

LIMIT = 16


def _llama(rope: dict) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LIMIT,
                         rope_parameters={"rope_theta": 10000.0, **rope}, **SPECIAL)
    return LlamaForCausalLM(config).eval()


def _phi3_longrope() -> Phi3ForCausalLM:
    torch.manual_seed(0)
    half_head = 4  # head_dim 8
    config = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * LIMIT,
                        original_max_position_embeddings=LIMIT,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                         "short_factor": [1.0] * half_head, "long_factor": [4.0] * half_head,
                                         "original_max_position_embeddings": LIMIT}, **SPECIAL)
    return Phi3ForCausalLM(config).eval()


MODELS = {
    "dynamic": lambda: _llama({"rope_type": "dynamic", "factor": 4.0}),
    "longrope": _phi3_longrope,
}


def test_the_kinds_and_their_limits_are_found():
    assert position_dependent_rope(MODELS["dynamic"]()) == [("dynamic", LIMIT)]
    assert position_dependent_rope(MODELS["longrope"]()) == [("longrope", LIMIT)]
    for static in ({"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0}):
        assert position_dependent_rope(_llama(static)) == []


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_exact_up_to_the_limit_refused_past_it(kind, cache):
    target = MODELS[kind]()
    draft = perturbed(target, scale=0.3)
    one, _ = left_padded([8], seed=1)  # 8 real tokens
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    at_limit = LIMIT - 8 + 1  # 8 + 9 - 1 = 16 positions: the frequencies never change
    for drafting in (dict(draft_model=draft, num_speculative_tokens=4), dict(prompt_lookup_num_tokens=3)):
        got = sk.generate(target, one, max_new_tokens=at_limit, cache_implementation=cache, **drafting, **common)
        assert torch.equal(got, target.generate(one, max_new_tokens=at_limit, **common))
        with pytest.raises(ValueError, match=rf"rope_type='{kind}'.*passes {LIMIT} positions.*reaches 17"):
            sk.generate(target, one, max_new_tokens=at_limit + 1, cache_implementation=cache, **drafting, **common)
    # A batch: a row near its end is verified beside rows with more tokens left, with gamma drafts past its last
    # position, and the frequencies follow the whole forward's longest position: the limit holds gamma more
    ids, mask = left_padded([8, 5], seed=1)  # the longest row has 8 real tokens
    for gamma, drafting in ((4, dict(draft_model=draft, num_speculative_tokens=4)), (3, dict(prompt_lookup_num_tokens=3))):
        new = at_limit - gamma
        got = sk.generate(target, ids, attention_mask=mask, max_new_tokens=new, cache_implementation=cache,
                          **drafting, **common)
        assert torch.equal(got, target.generate(ids, attention_mask=mask, max_new_tokens=new, **common))
        with pytest.raises(ValueError, match=rf"rope_type='{kind}'.*reaches 17 .*plus up to {gamma} drafted positions"):
            sk.generate(target, ids, attention_mask=mask, max_new_tokens=new + 1, cache_implementation=cache,
                        **drafting, **common)


def test_past_the_limit_the_speculative_logits_would_differ():
    """Why the refusal: HF's own assisted generation (which has no such check) drifts from model.generate past the
    limit, by far more than rounding, while it matches to rounding up to it."""
    target = _phi3_longrope()
    draft = perturbed(target, scale=0.3)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                  return_dict_in_generate=True, num_assistant_tokens=4, num_assistant_tokens_schedule="constant")

    def drift(new: int) -> float:
        """The largest logit difference between assisted and plain generate (inf once their tokens differ)."""
        plain = target.generate(ids, max_new_tokens=new, **{k: v for k, v in common.items() if "assistant" not in k})
        assisted = target.generate(ids, max_new_tokens=new, assistant_model=draft, **common)
        if not torch.equal(plain.sequences, assisted.sequences):
            return float("inf")
        return max((a - b).abs().max().item() for a, b in zip(plain.logits, assisted.logits))

    at_limit, past_it = drift(LIMIT - 8 + 1), drift(LIMIT - 8 + 2)
    assert at_limit < 1e-5  # rounding (measured ~1e-7)
    assert past_it > 100 * max(at_limit, 1e-7)  # measured 1.3e-3: the long factors in the verification forward


def test_continuous_batching_refuses_a_request_past_the_limit():
    target = MODELS["dynamic"]()
    decoder = sk.SpeculativeDecoder(target, perturbed(target, scale=0.3), num_speculative_tokens=3)
    # (every request joins one batch: gamma 3 past its last position, as in test_exact_up_to_the_limit_refused_past_it)
    decoder.add_request(list(range(3, 11)), max_new_tokens=6, do_sample=False)  # 8 + 6 - 1 + 3 = 16: admitted
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        decoder.add_request(list(range(3, 12)), max_new_tokens=6, do_sample=False)  # 17


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_longrope_prompt_already_past_the_limit_is_exact(cache):
    """longrope picks one set of factors per forward: a prompt long enough that the first forward (the prompt less
    its last token) is past the limit uses the long factors everywhere, in model.generate and here: exact. A prompt
    of exactly limit + 1 tokens would switch between our first forward and HF's, and is refused."""
    target = _phi3_longrope()
    draft = perturbed(target, scale=0.3)
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=12, cache_implementation=cache)
    ids, mask = left_padded([LIMIT + 2, LIMIT - 3], seed=2)  # the longest row's first forward: LIMIT + 1 positions
    hf_common = {k: v for k, v in common.items() if k != "cache_implementation"}
    expected = target.generate(ids, attention_mask=mask, **hf_common)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3, **common)
    assert torch.equal(got, expected)
    ids, mask = left_padded([LIMIT + 1], seed=2)
    with pytest.raises(ValueError, match="give a prompt longer than 17 tokens"):
        sk.generate(target, ids, attention_mask=mask, draft_model=draft, **common)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)  # batch-mates set a forward's longest
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        decoder.add_request(list(range(3, 3 + LIMIT + 2)), max_new_tokens=4, do_sample=False)
