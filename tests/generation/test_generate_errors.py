"""Every unsupported or invalid input gets a clear error naming it."""

import copy

import pytest
import torch

import speculative_kernels as sk
from helpers.models import gpt2, llama


@pytest.fixture(scope="module")
def pair():
    return llama(), llama(layers=1, seed=3)


def _ids():
    return torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(num_speculative_tokens=0), ValueError, "num_speculative_tokens must be >= 1"),
        (dict(num_speculative_tokens=2.5), TypeError, "num_speculative_tokens must be an int"),
        (dict(do_sample=True, temperature=-0.5), ValueError, "temperature"),
        (dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
        (dict(do_sample=True, top_p=0.0), ValueError, "top_p"),
        (dict(do_sample=True, top_k=-1), ValueError, "top_k"),
        (dict(num_beams=2), ValueError, "num_beams"),
        (dict(num_return_sequences=2), ValueError, "num_return_sequences"),  # greedy: one sequence (HF's check)
        (dict(num_return_sequences=0, do_sample=True), ValueError, "num_return_sequences"),
        (dict(repetition_penalty=-1.0), ValueError, "penalty"),  # HF's processor's own check
        (dict(no_repeat_ngram_size=-2), ValueError, "ngram_size"),
        (dict(logits_processor=[lambda ids, scores, extra: scores]), ValueError, "more arguments"),
        (dict(output_attentions=True, return_dict_in_generate=True), ValueError, "output_attentions"),
        (dict(use_cache=False), ValueError, "use_cache"),
        (dict(some_unknown_flag=3), ValueError, "some_unknown_flag"),
        # (a legacy tuple cache: model.generate refuses it too; a DynamicCache is taken, ``test_prompt_cache.py``)
        (dict(past_key_values=((), ())), ValueError, "past_key_values must be a transformers DynamicCache"),
        (dict(cache=((), ())), ValueError, "cache must be a transformers DynamicCache"),  # 5.24's name
        (dict(backend="tpu"), ValueError, "backend"),
        (dict(backend="cuda"), RuntimeError, "'cuda' cannot run"),
        (dict(cache_implementation="offloaded"), ValueError, "cache_implementation"),
        # (model.generate fails on these five inside transformers, on an operator or an iteration)
        (dict(num_return_sequences="2", do_sample=True), ValueError, "num_return_sequences must be an int >= 1"),
        (dict(suppress_tokens=5), TypeError, "suppress_tokens must be a list of token ids, got int 5"),
        (dict(begin_suppress_tokens=3), TypeError, "begin_suppress_tokens must be a list of token ids"),
        (dict(exponential_decay_length_penalty=5), TypeError, "exponential_decay_length_penalty must be a pair"),
        (dict(typical_p="0.5", do_sample=True), TypeError, "typical_p must be a number, got str"),
        # (HF then adds its draft-confidence stopping criterion: stops no target run makes; it was ignored)
        (dict(is_assistant=True), ValueError, "is_assistant=True is not supported .*draft-confidence"),
        (dict(penalty_alpha=0.6, top_k=4), ValueError, "penalty_alpha=0.6 is not supported"),
    ],
)
def test_bad_arguments(pair, kwargs, error, match):
    target, draft = pair
    with pytest.raises(error, match=match):
        sk.generate(target, _ids(), draft_model=draft, max_new_tokens=4, **kwargs)


def test_a_penalty_alpha_of_zero_is_greedy_as_in_hf(pair):
    """HF's contrastive search needs penalty_alpha > 0; penalty_alpha=0 is its greedy search (it was refused)."""
    target, draft = pair
    expected = target.generate(_ids(), max_new_tokens=6, do_sample=False, penalty_alpha=0.0, top_k=4)
    assert torch.equal(sk.generate(target, _ids(), draft_model=draft, max_new_tokens=6, penalty_alpha=0.0, top_k=4),
                       expected)


def test_missing_or_conflicting_draft(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="draft_model"):
        sk.generate(target, _ids(), max_new_tokens=4)
    with pytest.raises(ValueError, match="either draft_model or assistant_model"):
        sk.generate(target, _ids(), draft_model=draft, assistant_model=target, max_new_tokens=4)


def test_different_vocabularies(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="different vocabularies"):
        sk.generate(target, _ids(), draft_model=llama(vocab=120), max_new_tokens=4)
    with pytest.raises(ValueError, match="different vocabularies"):
        sk.generate(target, _ids(), draft_model=gpt2(vocab=50), max_new_tokens=4)


def test_tokenizers_that_disagree():
    from speculative_kernels.generation.vocab import check_tokenizers

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    check_tokenizers(Tok({"a": 0, "b": 1}), Tok({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="different vocabularies"):
        check_tokenizers(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}))


def test_padded_draft_vocabulary_is_exact_with_shared_tokenizer():
    """A draft whose vocabulary is a prefix of the target's (padding) is accepted when the tokenizers agree."""

    class Tok:
        def get_vocab(self):
            return {f"t{i}": i for i in range(90)}

    target = llama()
    # (the second prompt holds ids the narrower draft cannot embed, 90 (its width exactly) and up: fed to it as 0)
    for ids in (_ids(), torch.tensor([[5, 89, 90, 91, 96, 90]])):
        for draft in (llama(layers=1, vocab=90, seed=4), llama(layers=1, vocab=128, seed=4)):
            expected = target.generate(ids, max_new_tokens=10, do_sample=False)
            got = sk.generate(target, ids, draft_model=draft, tokenizer=Tok(), assistant_tokenizer=Tok(),
                              max_new_tokens=10, do_sample=False)
            assert torch.equal(got, expected)


def test_empty_prompt_starts_from_bos(pair):
    """A [1, 0] prompt (model.generate raises inside the model) is generated as model.generate does with no
    input_ids: from the BOS token, which the output holds (README's table of what we do differently)."""
    target, draft = pair
    expected = target.generate(max_new_tokens=6, do_sample=False)
    got = sk.generate(target, torch.zeros(1, 0, dtype=torch.int64), draft_model=draft, max_new_tokens=6,
                      do_sample=False)
    assert torch.equal(got, expected) and got[0, 0] == target.generation_config.bos_token_id


def test_empty_prompt_without_bos(pair):
    target, draft = pair
    target.generation_config.bos_token_id = None
    try:
        with pytest.raises(ValueError, match="bos_token_id"):
            sk.generate(target, torch.zeros(1, 0, dtype=torch.int64), draft_model=draft, max_new_tokens=3)
    finally:
        target.generation_config.bos_token_id = 1


def test_empty_prompt_whose_bos_is_the_pad_id_is_refused(pair):
    """bos_token_id == pad_token_id (not an EOS id): model.generate starts from [[bos]] and then infers the mask from
    pad_token_id, which masks that BOS: it decodes from an all-padding prompt, which we refuse by name (as an
    explicit [[pad]] prompt), for None and [1, 0] input_ids, in generate and start(). (The mask was inferred before
    the BOS prompt was made: the BOS was attended, other tokens than model.generate's.)"""
    target, draft = pair
    config = target.generation_config
    saved = config.bos_token_id, config.pad_token_id
    config.bos_token_id = config.pad_token_id = 9
    try:
        for ids in (None, torch.zeros(1, 0, dtype=torch.int64)):
            with pytest.raises(ValueError, match="bos_token_id equals pad_token_id"):
                sk.generate(target, ids, draft_model=draft, max_new_tokens=4)
        with pytest.raises(ValueError, match="bos_token_id equals pad_token_id"):
            sk.SpeculativeDecoder(target, draft).start(None, max_new_tokens=4)
        # the caller's own mask (HF infers none then), or a pad id that is an EOS id: generated from the BOS
        got = sk.generate(target, None, attention_mask=torch.ones(1, 1, dtype=torch.int64), draft_model=draft,
                          max_new_tokens=4, do_sample=False)
        assert torch.equal(got, target.generate(attention_mask=torch.ones(1, 1, dtype=torch.int64), max_new_tokens=4,
                                                do_sample=False))
        got = sk.generate(target, None, draft_model=draft, max_new_tokens=4, do_sample=False, eos_token_id=[2, 9])
        assert torch.equal(got, target.generate(max_new_tokens=4, do_sample=False, eos_token_id=[2, 9]))
    finally:
        config.bos_token_id, config.pad_token_id = saved


def test_right_padding_is_refused(pair):
    target, draft = pair
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="right padding"):
        sk.generate(target, ids, attention_mask=mask, draft_model=draft, max_new_tokens=3)


def test_models_on_different_devices(pair, monkeypatch):
    target, _ = pair
    elsewhere = llama(layers=1, seed=3).to("meta")  # (weights not loaded, no offloading hook to load them)
    with pytest.raises(ValueError, match="draft_model has parameters on the meta device"):
        sk.generate(target, _ids(), draft_model=elsewhere, max_new_tokens=3)
    from speculative_kernels.generation import inputs

    draft = llama(layers=1, seed=3)  # a draft on another device (this machine has one: the device is patched)
    real = inputs.model_device
    monkeypatch.setattr(inputs, "model_device", lambda m, name="model": torch.device("meta") if m is draft
                        else real(m, name))
    with pytest.raises(ValueError, match="model is on cpu but draft_model is on meta; put both on one device"):
        sk.generate(target, _ids(), draft_model=draft, max_new_tokens=3)


def test_nan_logits_raise_instead_of_emitting(pair):
    """A target with NaN logits raises; so does a draft's NaN q under sampling (it is the distribution the drafts
    were drawn from). Greedy does not read q: a NaN draft still drafts (its argmax), and the target's argmax decides,
    as in HF's greedy assisted generation (e629dcf; it raised before)."""
    target, draft = pair
    broken = llama(layers=1, seed=3)
    with torch.no_grad():
        broken.lm_head.weight[5, 0] = float("nan")
    assert torch.equal(sk.generate(target, _ids(), draft_model=broken, max_new_tokens=4, do_sample=False),
                       target.generate(_ids(), max_new_tokens=4, do_sample=False))
    with pytest.raises(ValueError, match="NaN"):
        sk.generate(target, _ids(), draft_model=broken, max_new_tokens=4, do_sample=True)
    with pytest.raises(ValueError, match="NaN"):
        sk.generate(broken, _ids(), draft_model=draft, max_new_tokens=4, do_sample=True)


def test_invalid_target_logits_say_whether_processors_made_them(pair):
    """The refusal names the target's logits as the model's, or, where HF's processors ran over them first, as
    theirs after those (a NaN of transformers 5.17's exponential_decay_length_penalty over min_new_tokens' -inf
    named the model's logits, which were finite: a user looked for a broken checkpoint)."""
    target, draft = pair
    broken = llama(layers=1, seed=3)
    with torch.no_grad():
        broken.lm_head.weight[5, 0] = float("nan")
    with pytest.raises(ValueError, match=r"target_logits, the target's logits \(LlamaForCausalLM\), has NaN"):
        sk.generate(broken, _ids(), draft_model=draft, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match=r"target_logits, the target's logits \(LlamaForCausalLM\) after the logits "
                                         r"processors and warpers of the settings, has NaN"):
        sk.generate(target, _ids(), draft_model=draft, max_new_tokens=4, do_sample=False,
                    sequence_bias={(7,): float("inf")})


def test_stats_type_checked(pair):
    target, draft = pair
    with pytest.raises(TypeError, match="speculation_stats"):
        sk.generate(target, _ids(), draft_model=draft, max_new_tokens=3, speculation_stats={})


def test_a_target_with_active_dropout_is_refused():
    """A target in training mode with dropout (model.train(), or built from a config without .eval()): every forward
    is random, model.generate's too, so greedy output differed from HF's silently. Refused by generate, start() and
    add_request, naming the dropout; a model in training mode without dropout, and a draft with it, are fine."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    target = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                        bos_token_id=1, eos_token_id=2))
    assert target.training and target.transformer.drop.p > 0
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    draft = copy.deepcopy(target)  # in training mode, with dropout: allowed
    message = r"GPT2LMHeadModel is in training mode with dropout active \(transformer.drop: p=0.1\).*model.eval\(\)"
    with pytest.raises(ValueError, match=message):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=4)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=2)
    with pytest.raises(ValueError, match=message):
        decoder.start(ids, max_new_tokens=4)
    with pytest.raises(ValueError, match=message):
        decoder.add_request([5, 17, 42], max_new_tokens=4)
    target.eval()
    assert torch.equal(sk.generate(target, ids, draft_model=draft, max_new_tokens=4, do_sample=False),
                       target.generate(ids, max_new_tokens=4, do_sample=False))
    no_dropout = llama()  # Llama's default attention dropout is 0: training mode changes nothing
    no_dropout.train()
    assert sk.generate(no_dropout, ids, prompt_lookup_num_tokens=2, max_new_tokens=4).shape == (1, 9)


def _gpt2_with_dropout():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                      bos_token_id=1, eos_token_id=2))


def test_dropout_in_a_submodule_or_switched_on_after_start_is_refused():
    """Two gaps of the refusal above: a target in eval mode whose submodule was left in training mode (the check
    read the top-level flag only), and target.train() after start()/add_request (not checked again at step()): both
    ran the target with dropout, silently random."""
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    target = _gpt2_with_dropout().eval()
    draft = copy.deepcopy(target)
    target.transformer.train()
    with pytest.raises(ValueError, match=r"dropout active \(transformer: p=0.1\)|dropout active \(transformer\.drop"):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=4)
    target.eval()
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=2)
    session = decoder.start(ids, max_new_tokens=8, do_sample=False)
    request = decoder.add_request([5, 17, 42], max_new_tokens=8, do_sample=False)
    session.step()
    decoder.step()
    queued = decoder.add_request([9, 10, 11], max_new_tokens=4, do_sample=False)
    target.train()
    for step in (session.step, decoder.step):
        with pytest.raises(ValueError, match="training mode with dropout active"):
            step()
    assert decoder.result(queued).finish_reason is None and queued in decoder.queued  # (not admitted and failed)
    target.eval()  # refused before anything ran: both go on, exact
    while not session.finished:
        session.step()
    while decoder.has_work():
        decoder.step()
    assert torch.equal(session.sequences(), target.generate(ids, max_new_tokens=8, do_sample=False))
    assert decoder.result(request).token_ids == target.generate(
        torch.tensor([[5, 17, 42]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert decoder.result(queued).token_ids == target.generate(
        torch.tensor([[9, 10, 11]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()


def test_a_seed_with_a_random_draft_is_refused():
    """A draft in training mode with dropout is accepted (q is whatever its forward gave), but its dropout draws
    from torch's global generator, which seed= does not key: two calls with seed=11 gave different tokens, and the
    global generator advanced. With a seed it is refused by name; without one, as before."""
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    target, draft = _gpt2_with_dropout().eval(), _gpt2_with_dropout()
    message = r"seed=11 cannot make this run reproducible: draft_model \(GPT2LMHeadModel\) is in training mode"
    with pytest.raises(ValueError, match=message):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=4, do_sample=True, seed=11)
    with pytest.raises(ValueError, match=message):
        sk.SpeculativeDecoder(target, draft).start(ids, max_new_tokens=4, do_sample=True, seed=11)
    with pytest.raises(ValueError, match=r"seed=11 cannot make this run reproducible: draft \(GPT2LMHeadModel\)"):
        sk.SpeculativeDecoder(target, draft).add_request([5, 17, 42], max_new_tokens=4, do_sample=True, seed=11)
    assert sk.generate(target, ids, draft_model=draft, max_new_tokens=4, do_sample=True).shape == (1, 9)
    # greedy output is exact whatever the draft's dropout draws: a seed there is no promise to break
    assert torch.equal(sk.generate(target, ids, draft_model=draft, max_new_tokens=4, do_sample=False, seed=11),
                       target.generate(ids, max_new_tokens=4, do_sample=False))


def test_other_training_mode_randomness_is_refused():
    """Dropout is not the only randomness of training mode: LayerDrop (OPT, BART, ...) skips layers at random and
    MoE routers multiply their input by jitter noise (Mixtral, Qwen-MoE, DBRX); both were accepted (no dropout)."""
    from transformers import MixtralConfig, MixtralForCausalLM, OPTConfig, OPTForCausalLM

    ids = torch.tensor([[5, 17, 42, 70]])
    sizes = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    mixtral = MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
                                               router_jitter_noise=0.1, **sizes))
    opt = OPTForCausalLM(OPTConfig(ffn_dim=64, layerdrop=0.5, dropout=0.0, attention_dropout=0.0,
                                   activation_dropout=0.0, word_embed_proj_dim=32, **sizes))
    for model, where in ((mixtral, r"model.layers.0.mlp: jitter_noise=0.1"), (opt, r"model.decoder: layerdrop=0.5")):
        assert model.training
        with pytest.raises(ValueError, match=rf"training-mode randomness active \({where}\).*model.eval\(\)"):
            sk.generate(model, ids, prompt_lookup_num_tokens=2, max_new_tokens=4)
        model.eval()
        assert torch.equal(sk.generate(model, ids, prompt_lookup_num_tokens=2, max_new_tokens=4, do_sample=False),
                           model.generate(ids, max_new_tokens=4, do_sample=False))


def test_spectral_norm_in_training_mode_is_refused():
    """spectral_norm runs a power iteration at every forward in training mode, so the weight depends on how many
    forwards ran (one per token in model.generate): 2 of 6 prompts gave other tokens, silently. Refused (as the
    parametrization and as the older hook); in eval mode it is exact."""
    import copy

    from torch.nn.utils import spectral_norm as hook_spectral_norm
    from torch.nn.utils.parametrizations import spectral_norm

    ids = torch.tensor([[5, 17, 42, 70]])
    for apply, where in ((spectral_norm, r"model.layers.0.self_attn.o_proj.parametrizations.weight.0"),
                         (hook_spectral_norm, r"model.layers.0.self_attn.o_proj")):
        model = llama()
        for layer in model.model.layers:
            apply(layer.self_attn.o_proj)
        model.train()
        with pytest.raises(ValueError, match=rf"training mode with spectral_norm \({where}.*model.eval\(\)"):
            sk.generate(model, ids, draft_model=copy.deepcopy(model), max_new_tokens=4)
        model.eval()
        assert torch.equal(sk.generate(model, ids, draft_model=copy.deepcopy(model), num_speculative_tokens=2,
                                       max_new_tokens=8, do_sample=False),
                           model.generate(ids, max_new_tokens=8, do_sample=False))


def test_gradient_checkpointing_in_training_mode_is_refused():
    """gradient_checkpointing_enable() and training mode (generating inside a training loop): transformers'
    checkpointed layers drop past_key_values, so no KV cache is read or filled; this crashed deep inside the model
    (a shape mismatch). Refused by name for the target and the draft, on every entry point; in eval mode it is exact."""
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    target, draft = llama(), llama(layers=1, seed=3)
    expected = target.generate(ids, max_new_tokens=6, do_sample=False)
    for model, name in ((target, "model"), (draft, "draft_model")):
        model.gradient_checkpointing_enable()
        model.train()
        message = rf"{name} \(LlamaForCausalLM\) has gradient checkpointing active in training mode.*{name}.eval\(\)"
        with pytest.raises(ValueError, match=message):
            sk.generate(target, ids, draft_model=draft, max_new_tokens=6, do_sample=False)
        with pytest.raises(ValueError, match=message):
            sk.SpeculativeDecoder(target, draft).start(ids, max_new_tokens=6, do_sample=False)
        with pytest.raises(ValueError, match="gradient checkpointing active"):
            sk.SpeculativeDecoder(target, draft).add_request([5, 17, 42], max_new_tokens=4)
        model.eval()
        assert torch.equal(sk.generate(target, ids, draft_model=draft, max_new_tokens=6, do_sample=False), expected)


def test_a_torch_compile_wrapper_is_named():
    """torch.compile(model) (an OptimizedModule) was refused as "a cache-less or recurrent model"; the error now says
    what it is and what to pass instead."""
    target = llama()
    wrapped = torch.compile(target)
    ids = torch.tensor([[5, 17, 42]])
    for model, draft, name in ((wrapped, target, "model"), (target, wrapped, "draft_model")):
        with pytest.raises(TypeError, match=rf"{name} is a torch.compile wrapper \(OptimizedModule\) of "
                                            rf"LlamaForCausalLM; pass the model itself \({name}._orig_mod\)"):
            sk.generate(model, ids, draft_model=draft, max_new_tokens=3)
    with pytest.raises(TypeError, match="torch.compile wrapper"):
        sk.SpeculativeDecoder(wrapped, target).add_request([5, 17, 42], max_new_tokens=3)


def test_model_inputs_we_do_not_take_are_named_with_the_reason(pair):
    """model.generate passes extra model inputs on to the forward; we refuse them by name, saying why."""
    target, draft = pair
    embeds = target.get_input_embeddings()(_ids())
    with pytest.raises(ValueError, match=r"\['inputs_embeds'\]; inputs_embeds is not supported: the draft and the "
                                         r"drafters read token ids \(pass input_ids\)"):
        sk.generate(target, draft_model=draft, inputs_embeds=embeds, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"\['pixel_values'\]; generating from images"):
        sk.generate(target, _ids(), draft_model=draft, pixel_values=torch.zeros(1, 3, 8, 8), max_new_tokens=3)
    with pytest.raises(ValueError, match=r"\['labels'\]$"):
        sk.generate(target, _ids(), draft_model=draft, labels=_ids(), max_new_tokens=3)


def test_a_request_past_a_learned_position_table_is_refused_by_name():
    """A learned absolute-position table (GPT-2's n_positions) shorter than the request: model.generate fails with an
    IndexError inside the embedding, and so did we, for the target and for a draft (where model.generate itself
    runs, and HF's assisted generation fails the same way). Up front, naming the model and the limit; a request
    that fills the table exactly runs, token-identical."""
    short, long = gpt2(seed=0), gpt2(layers=1, seed=1)
    for model in (short, long):
        model.transformer.wpe = torch.nn.Embedding(16, model.config.n_embd)  # as a checkpoint of n_positions=16
    short.config.n_positions = 16
    ids = _ids()  # 5 tokens
    expected = short.generate(ids, max_new_tokens=12, do_sample=False)  # positions 0..15: fills the table
    assert torch.equal(sk.generate(short, ids, draft_model=gpt2(layers=1, seed=1), max_new_tokens=12), expected)
    with pytest.raises(ValueError, match=r"model \(GPT2LMHeadModel\) has a learned position table of 16 positions, "
                                         r"and this request reaches 17"):
        sk.generate(short, ids, draft_model=gpt2(layers=1, seed=1), max_new_tokens=13)
    long.config.n_positions = 16
    with pytest.raises(ValueError, match=r"draft_model \(GPT2LMHeadModel\) has a learned position table of 16 .*"
                                         r"reaches 29.*or use a draft with a longer context"):
        sk.generate(gpt2(seed=0), ids, draft_model=long, max_new_tokens=25)
    decoder = sk.SpeculativeDecoder(gpt2(seed=0), long)  # continuous batching: refused by add_request
    with pytest.raises(ValueError, match=r"draft \(GPT2LMHeadModel\) has a learned position table of 16"):
        decoder.add_request([5, 17, 42], max_new_tokens=27)


def test_a_batch_row_near_its_end_reaches_gamma_positions_past_it():
    """In a batch, gamma follows the row with the most tokens left, so a row near its end is verified with drafts
    past its last position (never accepted): a padded batch that fills a learned table exactly was accepted and
    failed with an IndexError inside GPT-2's embedding (CTRL's sinusoid buffer, unchecked, at batch 1 too; and in
    continuous batching the failing step ended every request beside it). The limit holds gamma more in a batch and
    in continuous batching, refused up front by name; a batch gamma short of the table runs, token-identical."""
    from transformers import CTRLConfig, CTRLLMHeadModel

    from helpers.prompts import left_padded

    short = gpt2(seed=0)
    short.transformer.wpe = torch.nn.Embedding(16, short.config.n_embd)
    short.config.n_positions = 16
    ids, mask = left_padded([5, 3], seed=3)
    common = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    draft = gpt2(layers=1, seed=1)
    with pytest.raises(ValueError, match=r"reaches 19 \(prompt \+ max_new_tokens - 1 plus up to 3 drafted positions"):
        sk.generate(short, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=12, **common)
    expected = short.generate(ids, max_new_tokens=9, **common)
    assert torch.equal(sk.generate(short, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=9,
                                   **common), expected)
    # one call's rows share max_new_tokens: a row at its end has a batch-mate at most max_new_tokens - 2 drafts ahead
    ids2, mask2 = left_padded([14, 10], seed=3)
    common2 = dict(attention_mask=mask2, do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=2)
    assert torch.equal(sk.generate(short, ids2, draft_model=draft, num_speculative_tokens=3, **common2),
                       short.generate(ids2, **common2))
    decoder = sk.SpeculativeDecoder(short, draft, num_speculative_tokens=3)
    with pytest.raises(ValueError, match=r"target \(GPT2LMHeadModel\) has a learned position table of 16"):
        decoder.add_request([5, 17, 42, 70, 7], max_new_tokens=12, do_sample=False)

    torch.manual_seed(0)
    ctrl = CTRLLMHeadModel(CTRLConfig(vocab_size=97, n_positions=16, n_embd=32, dff=64, n_layer=2, n_head=4)).eval()
    with pytest.raises(ValueError, match=r"model \(CTRLLMHeadModel\) has a learned position table of 16 positions, "
                                         r"and this request reaches 17"):
        sk.generate(ctrl, _ids(), draft_model=ctrl, max_new_tokens=13)

    # GPT-J's and CodeGen's rotary sin/cos: a buffer [n_positions, rotary_dim] indexed by position (an IndexError
    # inside transformers, a device-side assert on CUDA, in a batch at the table's size and one past it at batch 1)
    from transformers import CodeGenConfig, CodeGenForCausalLM, GPTJConfig, GPTJForCausalLM

    for make, config in ((GPTJForCausalLM, GPTJConfig), (CodeGenForCausalLM, CodeGenConfig)):
        torch.manual_seed(0)
        model = make(config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=16,
                            n_ctx=16)).eval()
        name = make.__name__
        with pytest.raises(ValueError, match=rf"model \({name}\) has a learned position table of 16 positions, "
                                             r"and this request reaches 17"):
            sk.generate(model, _ids(), draft_model=model, max_new_tokens=13)
        assert torch.equal(sk.generate(model, _ids(), draft_model=model, max_new_tokens=12),
                           model.generate(_ids(), max_new_tokens=12, do_sample=False))
        with pytest.raises(ValueError, match=rf"target \({name}\) has a learned position table of 16"):
            sk.SpeculativeDecoder(model, model, num_speculative_tokens=3).add_request([5, 17, 42, 70, 7],
                                                                                      max_new_tokens=12)


def test_a_float64_model_is_refused_up_front():
    """float64 target or draft: the verification takes float32/float16/bfloat16 logits; it failed after the prefill
    with a message about an internal drafter's output."""
    from helpers.models import llama

    target = llama()
    for kwargs in (dict(model=llama().double(), draft_model=target), dict(model=target, draft_model=llama().double())):
        name = "draft_model" if kwargs["draft_model"] is not target else "model"
        with pytest.raises(ValueError, match=f"{name} is float64"):
            sk.generate(kwargs["model"], torch.tensor([[5, 6, 7]]), draft_model=kwargs["draft_model"],
                        max_new_tokens=4)
    # without a draft model too (prompt lookup, a drafter: the check was skipped, and the CUDA kernels would refuse
    # the logits midway, naming an internal argument)
    with pytest.raises(ValueError, match="model is float64"):
        sk.generate(llama().double(), torch.tensor([[5, 6, 7]]), prompt_lookup_num_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="target is float64"):
        sk.SpeculativeDecoder(llama().double(), drafter=lambda: sk.NGramDrafter())


def test_typed_settings_take_what_model_generate_takes(pair):
    """The type checks of suppress_tokens / typical_p (and the like) refused a tensor or NumPy array of ids and a
    0-d tensor, which model.generate takes: they are taken, with model.generate's tokens."""
    import numpy as np

    target, draft = pair
    first = target.generate(_ids(), max_new_tokens=1, do_sample=False)[0, -1].item()
    for kwargs in (dict(suppress_tokens=torch.tensor([first, 7])), dict(suppress_tokens=np.array([first, 7])),
                   dict(begin_suppress_tokens=torch.tensor([first]))):
        expected = target.generate(_ids(), max_new_tokens=6, do_sample=False, **kwargs)
        assert expected[0, 5].item() != first  # (the setting acts)
        assert torch.equal(sk.generate(target, _ids(), draft_model=draft, max_new_tokens=6, **kwargs), expected)
    sampled = sk.generate(target, _ids(), draft_model=draft, max_new_tokens=6, do_sample=True, seed=1,
                          typical_p=torch.tensor(0.5))
    assert torch.equal(sampled, sk.generate(target, _ids(), draft_model=draft, max_new_tokens=6, do_sample=True,
                                            seed=1, typical_p=0.5))


@pytest.mark.parametrize("name, value", [("typical_p", "0.5"), ("suppress_tokens", 5), ("repetition_penalty", "1.2"),
                                         ("exponential_decay_length_penalty", 5)])
def test_a_checkpoints_wrongly_typed_setting_is_named(name, value):
    """As the call's own: a checkpoint's generation_config.json that from_pretrained loads without complaint (HF's
    generate then fails inside transformers: "'int' object is not iterable")."""
    target = llama()
    setattr(target.generation_config, name, value)
    ids = torch.tensor([[1, 5, 9, 4]])
    with pytest.raises(TypeError, match=f"model's generation_config .*{name}"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=4, do_sample=True, seed=0)
    if name == "typical_p":  # the call's own value replaces the checkpoint's, as in model.generate
        sk.generate(target, ids, draft_model=target, max_new_tokens=4, do_sample=True, seed=0, typical_p=0.9)


def test_models_that_slice_a_position_sized_table_by_key_slots_are_kept_within_it():
    """MPT's ALiBi (built for max_seq_len keys) and GPT-Neo's global causal bias [1, 1, N, N] are sliced by the
    cache's key length: past N, transformers fails with a size mismatch. HF's caches hold no more slots than
    positions; the static cache holds prompt + new + 2(gamma + 1) + 2 (and compile=True rounds it up), a batch's
    dynamic cache the holes of rejected drafts: refused by name there (it was a RuntimeError inside transformers)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM, MptConfig, MptForCausalLM

    torch.manual_seed(0)
    mpt = MptForCausalLM(MptConfig(vocab_size=97, d_model=32, n_heads=4, n_layers=2, max_seq_len=32,
                                   use_cache=True, pad_token_id=0)).eval()
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(1))
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=12)
    assert torch.equal(sk.generate(mpt, ids, draft_model=mpt, num_speculative_tokens=4, **common),
                       mpt.generate(ids, **common))
    with pytest.raises(ValueError, match=r"model \(MptForCausalLM\) slices a table of 32 key positions .* 34 slots"):
        sk.generate(mpt, ids, draft_model=mpt, num_speculative_tokens=4, cache_implementation="static", **common)
    neo = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                                         max_position_embeddings=24, attention_types=[[["global"], 2]])).eval()
    with pytest.raises(ValueError, match=r"GPTNeoForCausalLM\) slices a table of 24 key positions"):
        sk.generate(neo, ids, draft_model=neo, cache_implementation="static", **common)


def test_a_checkpoints_sampling_only_setting_does_not_stop_greedy_decoding():
    """HF reads the warpers' fields only when sampling: a checkpoint's wrongly typed typical_p does not stop a
    greedy call (it did after the check above was added), nor does a negative id in its suppress_tokens."""
    target = llama()
    target.generation_config.typical_p = "0.5"
    target.generation_config.suppress_tokens = [-1, 5]
    ids = torch.tensor([[1, 5, 9, 4]])
    want = target.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(sk.generate(target, ids, draft_model=target, max_new_tokens=6, do_sample=False), want)
    with pytest.raises(TypeError, match="model's generation_config .*typical_p"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=6, do_sample=True, seed=0)
    from transformers import GenerationConfig

    target.generation_config.suppress_tokens = 5  # filled into a passed generation_config's unset field too
    with pytest.raises(TypeError, match="model's generation_config .*suppress_tokens"):
        sk.generate(target, ids, draft_model=target, generation_config=GenerationConfig(max_new_tokens=4))


def test_a_batch_of_a_slot_table_model_is_compacted_before_it_passes_the_table():
    """GPT-Neo (global layers only, 32 positions), a batch of 2 on the dynamic cache with an unrelated draft (many
    rejections, many holes): the runner compacts before an iteration would pass 32 slots, so a request HF runs
    is exact (it was refused mid-run at 16 new tokens)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    def neo(seed, layers=2):
        torch.manual_seed(seed)
        return GPTNeoForCausalLM(GPTNeoConfig(vocab_size=97, hidden_size=32, num_layers=layers, num_heads=4,
                                              max_position_embeddings=32, attention_types=[[["global"], layers]],
                                              bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()

    target, draft = neo(0), neo(7, layers=1)
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0
    common = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, **common),
                       target.generate(ids, **common))


def test_stop_strings_on_a_tokenizer_hfs_criterion_cannot_read_are_named():
    """A tokenizer without a decoder: HF's StopStringCriteria fails with 'substring not found' (model.generate too);
    the error names stop_strings and the tokenizer."""
    from helpers.checkpoints import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    target = llama(vocab=len(tokenizer))
    ids = torch.tensor([[1, 5, 9]])
    with pytest.raises(ValueError, match="substring not found"):
        target.generate(ids, max_new_tokens=4, stop_strings=["ab"], tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"stop_strings=\['ab'\]: transformers' StopStringCriteria cannot be built on "
                                         r"this tokenizer .*substring not found"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=4, stop_strings=["ab"], tokenizer=tokenizer)


def test_stop_strings_in_a_batch_without_an_eos_id_are_refused():
    """Without an EOS id model.generate pads nothing: a row that met its stop string goes on with the model's own
    tokens until every row has stopped (ours ended the row there and filled it with pad_token_id, or 0: other
    tokens, silently). Refused by name for a batch; one prompt, or a batch with an EOS id, is model.generate's."""
    from speculative_kernels.demo_pair import load_demo_pair

    target, draft, tokenizer = load_demo_pair()
    tokenizer.padding_side = "left"
    batch = tokenizer(["def fib(n):", "import os\nfor x in range(10):"], return_tensors="pt", padding=True)
    common = dict(max_new_tokens=12, stop_strings=["list"], tokenizer=tokenizer, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="stop_strings with a batch of 2 rows and eos_token_id=None"):
        sk.generate(target, **batch, draft_model=draft, eos_token_id=None, **common)
    with pytest.raises(ValueError, match="stop_strings with a batch of 2 rows and eos_token_id=None"):
        start = {k: v for k, v in common.items() if k != "tokenizer"}
        sk.SpeculativeDecoder(target, draft, tokenizer=tokenizer).start(
            batch["input_ids"], attention_mask=batch["attention_mask"], eos_token_id=None, **start)
    one = tokenizer(["def fib(n):"], return_tensors="pt")
    for ids, extra in ((one, dict(eos_token_id=None)), (batch, {})):
        assert torch.equal(sk.generate(target, **ids, draft_model=draft, **extra, **common),
                           target.generate(**ids, **extra, **common))


def test_one_id_settings_given_as_lists_and_checkpoint_ids_are_named():
    """pad_token_id as a list, and bos_token_id as one where the prompt starts from it, fail inside transformers
    (model.generate too): a TypeError naming them here; with a prompt given HF only keeps a bos list, and so do we.
    A checkpoint's invalid id (old conversions carry pad_token_id=-1) is refused saying where it came from and how to
    override it, and the override works."""
    target = llama()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(TypeError, match=r"pad_token_id must be one token id \(an int\)"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=3, pad_token_id=[50])
    with pytest.raises(TypeError, match=r"bos_token_id must be one token id \(an int\) to start a prompt from"):
        sk.generate(target, None, draft_model=target, max_new_tokens=3, bos_token_id=(9,))
    assert torch.equal(sk.generate(target, ids, draft_model=target, max_new_tokens=3, do_sample=False, bos_token_id=[1]),
                       target.generate(ids, max_new_tokens=3, do_sample=False, bos_token_id=[1]))
    saved = target.generation_config.pad_token_id
    target.generation_config.pad_token_id = -1
    try:
        with pytest.raises(ValueError, match=r"pad_token_id must be >= 0, got -1 \(from the model's or the passed "
                                             r"generation_config: pass pad_token_id= in the call"):
            sk.generate(target, ids, draft_model=target, max_new_tokens=3)
        got = sk.generate(target, ids, draft_model=target, max_new_tokens=3, pad_token_id=0, do_sample=False)
        assert torch.equal(got, target.generate(ids, max_new_tokens=3, pad_token_id=0, do_sample=False))
    finally:
        target.generation_config.pad_token_id = saved


def test_a_refused_setting_from_the_checkpoint_says_so(pair):
    """num_beams=4 from the model's generation_config (BART-large-cnn's generation_config.json) is refused saying
    where it comes from and how to decode without it; the call's own num_beams is refused without that."""
    target, draft = pair
    target.generation_config.num_beams = 4
    try:
        with pytest.raises(ValueError, match=r"num_beams=4 .*it is the model's generation_config's .*pass num_beams=1"):
            sk.generate(target, _ids(), draft_model=draft, max_new_tokens=3)
    finally:
        target.generation_config.num_beams = 1
    with pytest.raises(ValueError, match=r"num_beams=3 .*beam search is not speculative sampling\)$"):
        sk.generate(target, _ids(), draft_model=draft, max_new_tokens=3, num_beams=3)
