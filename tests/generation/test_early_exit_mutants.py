"""Early-exit drafting (``generation/early_exit.py``): the cases test_early_exit.py leaves open, each failing on a
mutant of the module or its wiring that it let through (mutation round 5)."""

import pytest
import torch
from transformers import GenerationConfig

import speculative_kernels as sk
from helpers.models import hf_generate, llama
from helpers.prompts import left_padded

NEW = 12


def test_a_passed_generation_configs_early_exit_drafts():
    """generate(generation_config=GenerationConfig(assistant_early_exit=N)) drafts with the first N layers, as
    model.generate does (the passed config's field, not only the keyword and the model's own config)."""
    target = llama(layers=3)
    ids = torch.tensor([[5, 6, 7, 8]])
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, generation_config=GenerationConfig(assistant_early_exit=1, max_new_tokens=NEW),
                      speculation_stats=stats)
    assert torch.equal(got, hf_generate(target, ids, max_new_tokens=NEW, do_sample=False))
    assert stats.drafted_tokens > 0


def test_the_keyword_overrides_the_passed_generation_config():
    """The keyword wins over the passed generation_config's field (model.generate's precedence): its value is the
    one checked, so an out-of-range value in the config the keyword replaces is not refused."""
    target = llama(layers=3)
    ids = torch.tensor([[5, 6, 7, 8]])
    got = sk.generate(target, ids, generation_config=GenerationConfig(assistant_early_exit=9, max_new_tokens=NEW),
                      assistant_early_exit=1)
    assert torch.equal(got, hf_generate(target, ids, max_new_tokens=NEW, do_sample=False))


def test_a_one_layer_model_is_refused_as_having_no_first_layers():
    with pytest.raises(ValueError, match="config has no num_hidden_layers of 2 or more \\(got 1\\)"):
        sk.generate(llama(layers=1), torch.tensor([[5, 6, 7]]), assistant_early_exit=1, max_new_tokens=3)


def test_two_lists_of_as_many_modules_beside_the_layers_are_refused():
    """A decoder holding another ModuleList of num_hidden_layers modules (e.g. per-layer adapters) next to its layers:
    which one is the layer list cannot be told, so it is refused by name, not guessed."""
    target = llama(layers=3)
    target.model.adapters = torch.nn.ModuleList(torch.nn.Identity() for _ in range(3))
    with pytest.raises(ValueError,
                       match="cannot tell LlamaForCausalLM's decoder layers .*model.layers, model.adapters"):
        sk.generate(target, torch.tensor([[5, 6, 7]]), assistant_early_exit=1, max_new_tokens=3)


def test_the_language_layers_are_found_from_get_decoder_beside_a_vision_tower_as_deep():
    """Qwen2-VL's vision blocks (model.visual.blocks) sit as deep below the model as its language layers
    (model.language_model.layers): get_decoder() tells which list drafts."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    vision = dict(depth=3, embed_dim=16, hidden_size=32, num_heads=2, in_chans=3, patch_size=2, spatial_merge_size=1,
                  temporal_patch_size=1)
    target = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=96, video_token_id=95, vision_start_token_id=94,
        vision_end_token_id=93)).eval()
    ids, mask = left_padded([7, 5])
    got = sk.generate(target, ids, attention_mask=mask, assistant_early_exit=1, max_new_tokens=NEW)
    assert torch.equal(got, hf_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))


def test_layers_two_levels_below_the_decoder_draft():
    """BertLMHeadModel as a decoder: its layers are bert.encoder.layer, two levels below its decoder (bert)."""
    from transformers import BertConfig, BertLMHeadModel

    torch.manual_seed(0)
    target = BertLMHeadModel(BertConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, is_decoder=True, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2)).eval()
    ids, mask = left_padded([7, 5])
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, assistant_early_exit=1, max_new_tokens=NEW,
                      speculation_stats=stats)
    assert torch.equal(got, hf_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    assert stats.drafted_tokens > 0


@pytest.mark.parametrize("target", ["a model name", None], ids=["string", "none"])
def test_the_decoder_names_a_target_that_is_not_a_model(target):
    """SpeculativeDecoder(target, assistant_early_exit=N) checks the target before building its draft from it."""
    with pytest.raises(TypeError, match="target must be a Hugging Face model"):
        sk.SpeculativeDecoder(target, assistant_early_exit=1)


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_the_drafts_config_lists_its_own_layers_types(family):
    """The draft's layer_types is cut to its N layers: transformers' config classes require one entry per layer (a
    config built from the draft's, e.g. to save or copy the draft, was refused: "num_hidden_layers (2) must be equal to
    the number of layer_types (4)"), and HF builds a cache layer per entry."""
    from transformers import DynamicCache

    from helpers.models import decoder_only_families
    from speculative_kernels.generation.early_exit import early_exit_draft

    target = decoder_only_families()[family](layers=4)
    draft = early_exit_draft(target, 2)
    assert list(draft.config.layer_types) == list(target.config.layer_types[:2])
    assert type(draft.config).from_dict(draft.config.to_dict()).num_hidden_layers == 2
    assert len(DynamicCache(config=draft.config).layers) == 2
    assert len(target.config.layer_types) == 4


def test_threads_building_the_draft_at_once_get_one_object(monkeypatch):
    """Four threads asking for the same draft while it is being built (slowed down here, so that they meet) get
    one object: compiled steps and continuous batching's joins key on it."""
    import threading
    import time

    from speculative_kernels.generation import early_exit

    build = early_exit._build_view

    def slow_build(*args, **kwargs):
        time.sleep(0.2)
        return build(*args, **kwargs)

    monkeypatch.setattr(early_exit, "_build_view", slow_build)
    target = llama(layers=3)
    views = []
    threads = [threading.Thread(target=lambda: views.append(early_exit.early_exit_draft(target, 2)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(views) == 4 and len({id(view) for view in views}) == 1


def test_prompt_lookup_in_a_passed_generation_config_is_a_way_of_drafting():
    """prompt_lookup_num_tokens counts as the call's drafting wherever the call sets it, its generation_config
    included: a checkpoint's assistant_early_exit yields to it, the call's own is refused beside it."""
    target = llama(layers=3)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    expected = hf_generate(target, ids, max_new_tokens=NEW, do_sample=False)
    target.generation_config.assistant_early_exit = 2  # (a checkpoint's)
    lookup = GenerationConfig(prompt_lookup_num_tokens=3, max_new_tokens=NEW)
    assert torch.equal(sk.generate(target, ids, generation_config=lookup), expected)
    with pytest.raises(ValueError, match="pass either assistant_early_exit .* or prompt_lookup_num_tokens"):
        sk.generate(target, ids, generation_config=lookup, assistant_early_exit=1)
