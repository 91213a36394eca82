"""Training-mode randomness (``capabilities._training_randomness``, ``check_deterministic``): the cases
test_generate_errors.py leaves open, each failing on the old code or on a mutant of the check it let through
(mutation round 6)."""

import pytest
import torch
import transformers

import speculative_kernels as sk

IDS = torch.tensor([[5, 17, 42, 70]])
SIZES = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)


def _bart(**dropouts):
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=97, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        **{"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, **dropouts}))


def _starcoder2(**dropouts):
    return transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
        intermediate_size=64, num_key_value_heads=2,
        **{"residual_dropout": 0.0, "attention_dropout": 0.0, "embedding_dropout": 0.0, **dropouts}, **SIZES))


def _biogpt(**dropouts):
    return transformers.BioGptForCausalLM(transformers.BioGptConfig(
        intermediate_size=64, **{"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                                 "activation_dropout": 0.0, **dropouts}, **SIZES))


def _dbrx(**dropouts):
    return transformers.DbrxForCausalLM(transformers.DbrxConfig(
        d_model=32, n_heads=4, n_layers=2, vocab_size=97, max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        **{"resid_pdrop": 0.0, "emb_pdrop": 0.0, **dropouts}))


DROPOUT_ATTRIBUTES = {  # (model, the module named in the refusal) for dropout read from another float attribute
    "starcoder2 residual_dropout": (lambda: _starcoder2(residual_dropout=0.3), r"model.layers.0.self_attn: p=0.3"),
    "starcoder2 embedding_dropout": (lambda: _starcoder2(embedding_dropout=0.3), r"model: p=0.3"),
    "biogpt activation_dropout": (lambda: _biogpt(activation_dropout=0.3), r"biogpt.layers.0: p=0.3"),
    "bart activation_dropout": (lambda: _bart(activation_dropout=0.3), r"model.encoder.layers.0: p=0.3"),
    "dbrx resid_pdrop": (lambda: _dbrx(resid_pdrop=0.3), r"transformer.blocks.0: p=0.3"),
}


@pytest.mark.parametrize("case", list(DROPOUT_ATTRIBUTES))
def test_dropout_read_from_other_attributes_is_refused(case):
    """transformers' layers apply dropout functionally with many attributes besides attention_dropout / dropout:
    ``F.dropout(x, p=self.activation_dropout, training=self.training)`` (BART, BioGPT, Marian, Pegasus, Whisper,
    ...), ``self.residual_dropout`` and ``self.embedding_dropout`` (Starcoder2), ``self.hidden_dropout`` (MPT),
    ``self.resid_pdrop`` (DBRX). In training mode with only such a dropout the target was accepted and every
    forward random (two forwards gave other logits), silently; in eval mode it is exact."""
    make, where = DROPOUT_ATTRIBUTES[case]
    torch.manual_seed(0)
    model = make()
    assert model.training
    with torch.no_grad():  # random indeed: the same forward twice gives other logits
        kwargs = {"decoder_input_ids": torch.tensor([[2, 5, 6]])} if model.config.is_encoder_decoder else {}
        assert not torch.equal(model(IDS, **kwargs).logits, model(IDS, **kwargs).logits)
    with pytest.raises(ValueError, match=rf"training mode with dropout active \({where}\).*model.eval\(\)"):
        sk.generate(model, IDS, prompt_lookup_num_tokens=2, max_new_tokens=4)
    model.eval()
    assert torch.equal(sk.generate(model, IDS, prompt_lookup_num_tokens=2, max_new_tokens=6, do_sample=False),
                       model.generate(IDS, max_new_tokens=6, do_sample=False))


def _moe(family, **fields):
    config_class, model_class = {"phimoe": (transformers.PhimoeConfig, transformers.PhimoeForCausalLM),
                                 "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[family]
    torch.manual_seed(0)
    return model_class(config_class(intermediate_size=64, num_key_value_heads=2, num_local_experts=4, **fields,
                                    **SIZES))


MOE_NOISE = {  # (model, the module and setting named in the refusal)
    "phimoe router_jitter_noise": (lambda: _moe("phimoe", router_jitter_noise=0.5),
                                   r"model.layers.0.mlp.router: router_jitter_noise=0.5"),
    "phimoe input_jitter_noise": (lambda: _moe("phimoe", router_jitter_noise=0.0, input_jitter_noise=0.2),
                                  r"model.layers.0.mlp: input_jitter_noise=0.2"),
}


@pytest.mark.parametrize("case", list(MOE_NOISE))
def test_moe_router_noise_is_refused(case):
    """PhiMoE's router in training mode: router_jitter_noise widens the set of experts its Gumbel sampling picks
    from, input_jitter_noise multiplies the input by uniform noise; each makes every forward random. Refused naming
    the setting; in eval mode exact."""
    make, where = MOE_NOISE[case]
    model = make()
    assert model.training
    with torch.no_grad():
        assert not torch.equal(model(IDS).logits, model(IDS).logits)
    with pytest.raises(ValueError, match=rf"training-mode randomness active \({where}\).*model.eval\(\)"):
        sk.generate(model, IDS, prompt_lookup_num_tokens=2, max_new_tokens=4)
    model.eval()
    assert torch.equal(sk.generate(model, IDS, prompt_lookup_num_tokens=2, max_new_tokens=6, do_sample=False),
                       model.generate(IDS, max_new_tokens=6, do_sample=False))


def test_dbrx_router_jitter_is_refused():
    """DBRX's router multiplies its input by uniform noise in training mode when moe_jitter_eps is set."""
    model = transformers.DbrxForCausalLM(transformers.DbrxConfig(
        d_model=32, n_heads=4, n_layers=2, vocab_size=97, max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2, "moe_jitter_eps": 0.1}))
    assert model.training
    with pytest.raises(ValueError, match=r"training-mode randomness active \(transformer.blocks.0.ffn.router: "
                                         r"moe_jitter_eps=0.1\)"):
        sk.generate(model, IDS, prompt_lookup_num_tokens=2, max_new_tokens=4)


@pytest.mark.parametrize("family", ["mixtral", "phimoe"])
def test_training_mode_with_its_noise_settings_at_zero_runs_exactly(family):
    """A model built from a config without .eval() whose noise settings are all 0 (Mixtral's defaults:
    router_jitter_noise=0.0, no dropout; PhiMoE with both jitters at 0: its Gumbel sampling then picks the top
    experts) is deterministic in training mode: not refused, exact."""
    model = _moe(family, router_jitter_noise=0.0, **({"input_jitter_noise": 0.0} if family == "phimoe" else {}))
    assert model.training
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, model(IDS).logits)
    assert torch.equal(sk.generate(model, IDS, prompt_lookup_num_tokens=2, max_new_tokens=6, do_sample=False),
                       model.generate(IDS, max_new_tokens=6, do_sample=False))
