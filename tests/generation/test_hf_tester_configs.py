"""Cases found by running generate against model.generate on the tiny configs of HF's own model testers
(``tests/models/<type>/test_modeling_<type>.py`` in transformers' repository: ``<Type>ModelTester.get_config()``),
which set what our own tiny configs do not (BigBird's block-sparse attention without ``is_decoder``, ...). Each
case is rebuilt here from the config fields that matter; nothing is read from HF's test sources."""

import pytest
import torch
from transformers import BigBirdConfig, BigBirdForCausalLM

import speculative_kernels as sk
from speculative_kernels.generation import request as request_module
from speculative_kernels.generation.capabilities import check_model


def _no_loop(*args, **kwargs):
    raise AssertionError("generate went past its up-front checks")


@pytest.mark.parametrize("attention_type", ["block_sparse", "original_full"])
def test_big_bird_without_is_decoder_is_refused_up_front(attention_type, monkeypatch):
    """BigBird's base model drops its cache with ``if not self.config.is_decoder: use_cache = False``, the negated
    form of the BERT family's guard, which the source check did not match. HF's tester config (is_decoder False,
    block-sparse attention, 128-token prompts) then crashed inside the block-sparse attention on the draft
    (RuntimeError), and HF's own reference is a bidirectional prefill (block-sparse: one that writes no cache)
    followed by steps that switch the model to full attention for good. Refused by name, as for BERT (transformers
    5.17, whose BigBird builds a bidirectional mask whatever is_decoder says, is refused for that first)."""
    config = BigBirdConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, attention_type=attention_type, block_size=2, num_random_blocks=1,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = BigBirdForCausalLM(config).eval()
    ids = torch.tensor([[60, 26, 3, 18, 86, 47, 91, 55, 12, 13]])
    reason = "is_decoder is False|bidirectional self-attention mask in this transformers version"
    with pytest.raises(ValueError, match=reason):
        check_model(model, path="dynamic", batch=1)
    monkeypatch.setattr(request_module, "make_runner", _no_loop)
    monkeypatch.setattr(request_module, "SpeculativeLoop", _no_loop)
    with pytest.raises(ValueError, match=f"BigBirdForCausalLM.*({reason})"):
        sk.generate(model, ids, prompt_lookup_num_tokens=3, max_new_tokens=4, pad_token_id=0)


def _tiny_blt():
    """A BLT whose config states num_hidden_layers at the top (as HF's tester sets it), so the layout check passes."""
    from transformers import BltConfig, BltForCausalLM

    sub = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               intermediate_size=32, max_position_embeddings=32)
    config = BltConfig(vocab_size=32, max_position_embeddings=32, patch_size=4, patching_mode="entropy",
                       patching_batch_size=1, cross_attn_k=2, encoder_hash_byte_group_size=[2, 3],
                       encoder_hash_byte_group_vocab=64, encoder_hash_byte_group_nb_functions=1,
                       patcher_config=sub, encoder_config=sub, global_config={**sub, "hidden_size": 32},
                       decoder_config={**sub, "vocab_size": 32, "hidden_size_global": 32}, tie_word_embeddings=False)
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    return BltForCausalLM(config).eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_blt_is_refused_up_front(cache, monkeypatch):
    """BLT's global transformer runs over the patches of each forward's own tokens, uncached, from position 0: a
    forward over several tokens gives logits up to 2.5 away from one-token steps. With HF's tester config (which
    states num_hidden_layers) it was driven: a TypeError from crop_cache after the first iteration on the dynamic
    cache (its EncoderDecoderCache), a RuntimeError inside the static runner. Refused by name on every path."""
    model = _tiny_blt()
    ids = torch.tensor([[5, 9, 3, 17, 22, 8, 11]])
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    monkeypatch.setattr(request_module, "make_runner", _no_loop)
    monkeypatch.setattr(request_module, "SpeculativeLoop", _no_loop)
    with pytest.raises(ValueError, match="BltForCausalLM.*global transformer runs over the patches"):
        sk.generate(model, ids, prompt_lookup_num_tokens=3, max_new_tokens=4, pad_token_id=0, **extra)
