"""Early-exit drafting (HF's ``assistant_early_exit``): the target's first N decoder layers, its final norm and LM
head draft, with no second model (``generation/early_exit.py``)."""

import threading

import pytest
import torch
from transformers import GenerationConfig
from transformers.models.llama.modeling_llama import LlamaModel

import speculative_kernels as sk
from speculative_kernels.generation.early_exit import _layer_path, early_exit_draft
from helpers.models import decoder_only_families, hf_generate, llama
from helpers.prompts import left_padded

NEW = 16


def _deep(family: str = "llama", layers: int = 4):
    """A target of 4 layers whose last two matter (BLOOM's initialisation leaves them near the identity: its first
    two layers alone drafted every token it verified, so its last layers' weights are scaled up)."""
    target = decoder_only_families()[family](layers=layers)
    with torch.no_grad():
        for parameter in target.get_submodule(".".join(_layer_path(target, layers)))[2:].parameters():
            parameter.mul_(10.0 if family == "bloom" else 1.0)
    return target


@pytest.mark.parametrize("family", sorted(decoder_only_families()))
def test_greedy_is_model_generate_in_a_padded_batch(family):
    target = _deep(family)
    ids, mask = left_padded([7, 4, 9])
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, assistant_early_exit=2, num_speculative_tokens=3,
                      max_new_tokens=NEW, speculation_stats=stats)
    assert torch.equal(got, hf_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    assert 0 < stats.acceptance_rate < 1  # a real draft: it is rejected at times


@pytest.mark.parametrize("extra", [{}, {"cache_implementation": "static"},
                                   {"cache_implementation": "static", "compile": sk.CompileOptions(backend="aot_eager")}],
                         ids=["dynamic", "static", "compiled"])
def test_greedy_is_hfs_own_early_exit_at_batch_one(extra):
    target = _deep()
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(3))
    got = sk.generate(target, ids, assistant_early_exit=1, max_new_tokens=NEW, **extra)
    assert torch.equal(got, hf_generate(target, ids, assistant_early_exit=1, max_new_tokens=NEW, do_sample=False))
    assert torch.equal(got, hf_generate(target, ids, max_new_tokens=NEW, do_sample=False))


def test_sampling_draws_as_the_same_layers_as_a_draft_model():
    """With one seed, the early-exit draft and a separate model holding the same first layers draw the same tokens:
    the early exit is a draft model like any other (whose exactness the sampling tests establish)."""
    target = _deep()
    twin = _deep()  # (the same weights: same seed)
    twin.model.layers = twin.model.layers[:2]
    twin.config.num_hidden_layers = 2
    ids, mask = left_padded([6, 8])
    common = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=20, seed=11,
                  num_speculative_tokens=4)
    assert torch.equal(sk.generate(target, ids, assistant_early_exit=2, **common),
                       sk.generate(target, ids, draft_model=twin, **common))


def test_the_draft_shares_the_targets_weights_and_leaves_it_as_it_was():
    target = _deep()
    draft = early_exit_draft(target, 2)
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2
    assert len(target.model.layers) == 4 and target.config.num_hidden_layers == 4
    assert draft.model.layers[1] is target.model.layers[1] and draft.lm_head is target.lm_head
    assert {p.data_ptr() for p in draft.parameters()} <= {p.data_ptr() for p in target.parameters()}
    assert early_exit_draft(target, 2) is draft  # one object per (model, N): compiled steps key on it
    target.config.rms_norm_eps = 1e-5  # a changed config: a new view, that follows it
    assert early_exit_draft(target, 2) is not draft
    target.lm_head = torch.nn.Linear(32, 97, bias=False)  # a replaced head: a new view, that drafts with it
    assert early_exit_draft(target, 2).lm_head is target.lm_head


def test_the_draft_follows_the_targets_mode_and_attention_implementation():
    """The view's copies of the model and its decoder take their plain attributes (``training``) and the config's
    private fields at build time: a target refused in training mode, then put in eval mode, drafts in eval mode (the
    old view's decoder stayed in training mode and dropped layers (OPT's LayerDrop): a crash inside transformers'
    attention), and one switched to eager attention drafts with eager attention."""
    target = _deep("opt")
    target.config.layerdrop = target.model.decoder.layerdrop = 0.5  # (a fine-tune's: LayerDrop in training mode)
    ids, mask = left_padded([7, 4])
    target.train()
    with pytest.raises(ValueError, match="call model.eval"):
        sk.generate(target, ids, attention_mask=mask, assistant_early_exit=2, max_new_tokens=NEW)
    target.eval()
    got = sk.generate(target, ids, attention_mask=mask, assistant_early_exit=2, max_new_tokens=NEW)
    assert torch.equal(got, hf_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    assert not any(module.training for module in early_exit_draft(target, 2).modules())
    draft = early_exit_draft(target, 2)
    hf_generate(target, ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static")
    assert early_exit_draft(target, 2) is draft  # (generate's bookkeeping on the model, not a change of its mode)
    target.set_attn_implementation("eager")
    assert early_exit_draft(target, 2).config._attn_implementation == "eager"


@pytest.mark.parametrize("value, error, match", [
    (0, ValueError, r"assistant_early_exit=0 must be in \[1, 3\]"),
    (4, ValueError, r"assistant_early_exit=4 must be in \[1, 3\]"),
    (2.0, TypeError, "assistant_early_exit must be an int"),
    (True, TypeError, "assistant_early_exit must be an int"),
    ("2", TypeError, "assistant_early_exit must be an int"),
])
def test_bad_values_are_refused_by_name(value, error, match):
    with pytest.raises(error, match=match):
        sk.generate(_deep(), torch.tensor([[5, 6, 7]]), assistant_early_exit=value, max_new_tokens=3)


@pytest.mark.parametrize("other", [{"draft_model": "DRAFT"}, {"prompt_lookup_num_tokens": 3},
                                   {"drafter": "NGRAM"}])
def test_another_way_of_drafting_in_the_call_is_refused(other):
    """model.generate ignores assistant_model silently when assistant_early_exit is set; here both are an error."""
    target = _deep()
    other = {k: {"DRAFT": llama(layers=1, seed=4), "NGRAM": sk.NGramDrafter(vocab_size=97)}.get(v, v) for k, v in other.items()}
    with pytest.raises(ValueError, match="pass either assistant_early_exit"):
        sk.generate(target, torch.tensor([[5, 6, 7]]), assistant_early_exit=2, max_new_tokens=3, **other)


def test_a_checkpoints_early_exit_drafts_and_yields_to_the_calls_draft():
    target = _deep()
    ids = torch.tensor([[5, 6, 7, 8]])
    # (the reference before the default is set: transformers 5.17's model.generate then runs the model as its own
    # assistant, whose generate assists again, and fails in its ConfidenceCriteria)
    expected = hf_generate(target, ids, max_new_tokens=NEW, do_sample=False)
    target.generation_config.assistant_early_exit = 2  # (as a checkpoint's generation_config.json would set it)
    stats = sk.SpeculationStats()
    assert torch.equal(sk.generate(target, ids, max_new_tokens=NEW, speculation_stats=stats), expected)
    assert stats.drafted_tokens > 0
    draft = llama(layers=1, seed=4)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, max_new_tokens=NEW), expected)
    assert torch.equal(sk.generate(target, ids, prompt_lookup_num_tokens=3, max_new_tokens=NEW), expected)
    with pytest.raises(ValueError, match=r"assistant_early_exit=9 \(the model's generation_config\) must be in"):
        target.generation_config.assistant_early_exit = 9
        sk.generate(target, ids, max_new_tokens=3)


def test_encoder_decoder_models_are_refused():
    from helpers.seq2seq_models import t5

    with pytest.raises(ValueError, match="assistant_early_exit is supported for decoder-only models"):
        sk.generate(t5(), torch.tensor([[5, 6, 7]]), assistant_early_exit=1, max_new_tokens=3)


class _CountingModel(LlamaModel):
    """A decoder whose forward reads the layer count beyond the loop (as models with input/output layer groups
    do): the first layers alone would not run as in the target."""

    def forward(self, *args, **kwargs):
        assert self.config.num_hidden_layers > 0
        return super().forward(*args, **kwargs)


def test_code_reading_the_layer_count_beyond_the_loop_is_refused():
    target = _deep()
    target.model.__class__ = _CountingModel
    with pytest.raises(ValueError, match=r"_CountingModel.forward read\(s\) num_hidden_layers beyond the loop"):
        sk.generate(target, torch.tensor([[5, 6, 7]]), assistant_early_exit=2, max_new_tokens=3)


@pytest.mark.parametrize("field", ["num_kv_shared_layers", "hidden_size_per_layer_input"])
def test_layers_sharing_caches_or_taking_per_layer_inputs_are_refused(field):
    target = _deep()
    setattr(target.config, field, 1)
    with pytest.raises(ValueError, match=f"assistant_early_exit is not supported for LlamaForCausalLM: .*{field}"):
        sk.generate(target, torch.tensor([[5, 6, 7]]), assistant_early_exit=2, max_new_tokens=3)


def test_a_forward_replaced_on_the_instance_is_refused():
    target = _deep()
    target.forward = target.forward  # (as torch.compile(model.forward) or accelerate's hooks set it)
    with pytest.raises(ValueError, match="LlamaForCausalLM.forward is replaced on the instance"):
        sk.generate(target, torch.tensor([[5, 6, 7]]), assistant_early_exit=2, max_new_tokens=3)


def test_a_multimodal_models_language_layers_draft():
    """get_decoder() tells the language model's layers from the vision tower's (both lists of 2 in tiny configs)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, CLIPVisionConfig

    torch.manual_seed(0)
    text = dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                              image_size=8, patch_size=4)
    target = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision.to_dict(),
                                                       image_token_id=96)).eval()
    ids, mask = left_padded([7, 5])
    got = sk.generate(target, ids, attention_mask=mask, assistant_early_exit=1, max_new_tokens=NEW)
    assert torch.equal(got, hf_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    draft = early_exit_draft(target, 1)
    assert len(draft.model.language_model.layers) == 1 and draft.model.vision_tower is target.model.vision_tower


def test_the_decoder_object_drafts_with_the_targets_first_layers():
    target = _deep()
    ids, mask = left_padded([7, 4])
    expected = hf_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    decoder = sk.SpeculativeDecoder(target, assistant_early_exit=2, num_speculative_tokens=3)
    session = decoder.start(ids, attention_mask=mask, max_new_tokens=NEW)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), expected)
    first = decoder.add_request(ids[0], max_new_tokens=NEW)
    second = decoder.add_request(ids[1][mask[1].bool()], max_new_tokens=NEW)
    while decoder.has_work():
        decoder.step()
    for request, row in ((first, 0), (second, 1)):
        tokens = decoder.result(request).token_ids  # (up to its EOS; model.generate pads the row after it)
        assert tokens == expected[row, ids.shape[1]:ids.shape[1] + len(tokens)].tolist()
        assert (expected[row, ids.shape[1] + len(tokens):] == 0).all()
    with pytest.raises(ValueError, match="assistant_early_exit is a setting of the decoder"):
        decoder.start(ids, attention_mask=mask, assistant_early_exit=1)
    with pytest.raises(ValueError, match=r"assistant_early_exit \(in generation_config\) is a setting of the decoder"):
        decoder.start(ids, attention_mask=mask, generation_config=GenerationConfig(assistant_early_exit=2))
    with pytest.raises(ValueError, match="pass one of draft, prompt_lookup_num_tokens, assistant_early_exit"):
        sk.SpeculativeDecoder(target, llama(layers=1), assistant_early_exit=2)
    with pytest.raises(ValueError, match=r"assistant_early_exit=4 must be in \[1, 3\]"):
        sk.SpeculativeDecoder(target, assistant_early_exit=4)


def test_the_decoder_object_drafts_with_the_target_as_it_is_at_each_session_and_request():
    """A decoder made before the target's embeddings are resized: its sessions and requests draft with the resized
    head (it kept the view of its construction: "draft and target have different vocabularies")."""
    target = _deep()
    decoder = sk.SpeculativeDecoder(target, assistant_early_exit=2, num_speculative_tokens=3)
    target.resize_token_embeddings(128, mean_resizing=False)
    ids, mask = left_padded([7, 4])
    expected = hf_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    session = decoder.start(ids, attention_mask=mask, max_new_tokens=NEW)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), expected)
    request = decoder.add_request(ids[0], max_new_tokens=NEW)
    while decoder.has_work():
        decoder.step()
    tokens = decoder.result(request).token_ids
    assert tokens == expected[0, ids.shape[1]:ids.shape[1] + len(tokens)].tolist()


def test_a_torch_compile_wrapper_is_refused_as_such():
    """Without suggesting to compile the forward on the instance, which early exit refuses in turn."""
    with pytest.raises(TypeError, match="model is a torch.compile wrapper") as error:
        sk.generate(torch.compile(_deep()), torch.tensor([[5, 6, 7]]), assistant_early_exit=2, max_new_tokens=3)
    assert "model.forward = torch.compile" not in str(error.value)
    with pytest.raises(TypeError, match="target is a torch.compile wrapper") as error:
        sk.SpeculativeDecoder(torch.compile(_deep()), assistant_early_exit=2)
    assert "target.forward = torch.compile" not in str(error.value)


def test_threads_building_the_draft_get_one_object():
    target = _deep()
    views = []
    threads = [threading.Thread(target=lambda: views.append(early_exit_draft(target, 3))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(view) for view in views}) == 1
