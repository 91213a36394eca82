"""Models whose code is not transformers': remote code next to the weights (``auto_map``, loaded with
``trust_remote_code=True``) and users' own subclasses of transformers classes. Exact against ``model.generate``, or
refused up front naming what cannot be reproduced."""

import json
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import speculative_kernels as sk
from speculative_kernels.generation.capabilities import check_model
from helpers.models import hf_generate, llama

# A remote-code decoder written as pre-2024 remote code is: it builds its causal and padding mask from a 2-D mask
# whatever it is given, over a transformers Cache. Its cache keyword is the one this transformers version's
# generate passes (``past_key_values`` up to 5.23, ``cache`` from 5.24), as a checkpoint's code for it would be.
REMOTE_CONFIG = '''
from transformers import PretrainedConfig


class TinyConfig(PretrainedConfig):
    model_type = "tiny_remote_decoder"

    def __init__(self, vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)
'''
REMOTE_MODEL = '''
import math

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_tiny import TinyConfig

CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class Layer(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        width, self.heads, self.index = config.hidden_size, config.num_attention_heads, index
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, cache, bias):
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(width, dim=2))
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        scores = q @ k.transpose(-1, -2) / math.sqrt(k.shape[-1]) + bias
        x = x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def get_output_embeddings(self):
        return self.lm_head

    def run(self, input_ids, attention_mask, position_ids, cache, use_cache):
        batch, length = input_ids.shape
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=input_ids.device).unsqueeze(0)
        x = self.wte(input_ids) + self.wpe(position_ids)
        low = torch.finfo(x.dtype).min
        causal = torch.ones(length, past + length, dtype=torch.bool, device=x.device).tril(past)
        bias = torch.zeros(batch, 1, length, past + length, dtype=x.dtype, device=x.device).masked_fill(~causal, low)
        if attention_mask is not None:  # (read as a 2-D mask, whatever its rank)
            bias = bias + (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * low
        for layer in self.layers:
            x = layer(x, cache, bias)
        return CausalLMOutputWithPast(logits=self.lm_head(self.norm(x)), **{CACHE: cache})

    if CACHE == "cache":
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                    return_dict=None, **kwargs):
            return self.run(input_ids, attention_mask, position_ids, cache, use_cache)
    else:
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, return_dict=None, **kwargs):
            return self.run(input_ids, attention_mask, position_ids, past_key_values, use_cache)
'''


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory):
    """The remote-code model, saved with its code and auto_map and loaded back as users load it."""
    folder = tmp_path_factory.mktemp("tiny_remote_decoder")
    (folder / "configuration_tiny.py").write_text(textwrap.dedent(REMOTE_CONFIG))
    (folder / "modeling_tiny.py").write_text(textwrap.dedent(REMOTE_MODEL))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "tiny_remote_decoder", "architectures": ["TinyForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig",
                     "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=True),
                                             trust_remote_code=True)
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def _prompts(batch: int):
    ids = torch.randint(3, 97, (batch, 6), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding
        ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def _check_exact(target, draft, batch: int, gamma: int, new: int = 12):
    ids, mask = _prompts(batch)
    expected = hf_generate(target, ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    out = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=gamma,
                      max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("batch,gamma", [(1, 1), (1, 3), (2, 3)])
def test_remote_code_mask_from_2d_is_given_the_2d_mask(remote_model, batch, gamma):
    """Remote code's 'eager' says nothing about 4-D masks: its own decoder stack is given the 2-D mask on the dynamic
    cache, as model.generate gives it (a 4-D mask gave other tokens at batch 1, a crash at batch 2)."""
    assert check_model(remote_model, batch=batch).mask == "2d"
    _check_exact(remote_model, remote_model, batch, gamma)


@pytest.mark.parametrize("batch", [1, 2])
def test_remote_code_as_draft_or_target_of_a_transformers_model(remote_model, batch):
    target = llama()
    _check_exact(target, remote_model, batch, 3)
    _check_exact(remote_model, target, batch, 3)


class BiasedLlama(LlamaForCausalLM):
    """A user's subclass whose forward adds a fixed bias to the logits, through *args/**kwargs."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + self.logit_bias
        return out


def _biased():
    model = llama()
    model.__class__ = BiasedLlama
    model.logit_bias = torch.zeros(model.config.vocab_size)
    model.logit_bias[[5, 7, 11]] = 2.0
    return model


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_subclass_forward_taking_star_args(batch, static):
    """A forward(self, *args, **kwargs) override passes the keywords on to its parent's forward, whose are read (it
    was refused as a model 'whose forward takes no past_key_values or cache'); its output change is kept."""
    model = _biased()
    ids, mask = _prompts(batch)
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=0,
                    **({"cache_implementation": "static"} if static else {}))
    expected = hf_generate(model, ids, attention_mask=mask, **settings)
    assert torch.equal(expected, hf_generate(model, ids, attention_mask=mask, **settings))
    assert not torch.equal(expected, hf_generate(llama(), ids, attention_mask=mask, **settings))  # (the bias acts)
    out = sk.generate(model, ids, attention_mask=mask, draft_model=llama(layers=1, seed=3), num_speculative_tokens=3,
                      **settings)
    assert torch.equal(out, expected)


class BoostingLlama(LlamaForCausalLM):
    """A user's subclass whose prepare_inputs_for_generation adds a keyword its forward reads."""

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return {**super().prepare_inputs_for_generation(*args, **kwargs), "boost_token": 5}

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, boost_token=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep,
                              **kwargs)
        if boost_token is not None:
            out.logits[..., boost_token] += 3.0
        return out


def test_subclass_prepare_inputs_for_generation_refused_as_target():
    """model.generate runs a user's prepare_inputs_for_generation at every step, the runners do not: as a target it
    is refused by name (it gave other tokens without a word); as a draft it only proposes."""
    model = llama()
    model.__class__ = BoostingLlama
    ids, mask = _prompts(1)
    with pytest.raises(ValueError, match="BoostingLlama.prepare_inputs_for_generation .*not transformers"):
        sk.generate(model, ids, attention_mask=mask, draft_model=llama(layers=1, seed=3), max_new_tokens=4)
    model.__class__ = LlamaForCausalLM
    model.prepare_inputs_for_generation = lambda *args, **kwargs: {}  # (on the instance)
    with pytest.raises(ValueError, match="instance attribute prepare_inputs_for_generation"):
        check_model(model)
    model.prepare_inputs_for_generation = llama(seed=5).prepare_inputs_for_generation  # (another model's)
    with pytest.raises(ValueError, match="instance attribute prepare_inputs_for_generation"):
        check_model(model)
    del model.prepare_inputs_for_generation
    draft = llama(layers=1, seed=3)
    draft.__class__ = BoostingLlama
    _check_exact(model, draft, 2, 3)


def test_the_class_own_method_bound_on_the_instance_runs():
    """``model.prepare_inputs_for_generation = model.prepare_inputs_for_generation`` changes nothing; a PEFT
    prompt-learning wrapper's generate leaves its base model so (it restores the bound method it saved), and the
    base model was refused after any such call (``get_base_model()``, or inside ``disable_adapter()``)."""
    model = llama()
    model.prepare_inputs_for_generation = model.prepare_inputs_for_generation
    _check_exact(model, llama(layers=1, seed=3), 2, 3)


class LegacyCacheLlama(LlamaForCausalLM):
    """A user's forward written for legacy caches: tuples of (key, value) per layer."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                **kwargs):
        past = 0 if past_key_values is None else past_key_values[0][0].shape[-2]  # (legacy: tuples)
        if position_ids is None:
            position_ids = torch.arange(past, past + input_ids.shape[1]).unsqueeze(0)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, **kwargs)


class TupleLlama(LlamaForCausalLM):
    """A user's forward returning tuples whatever return_dict says."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs).to_tuple()


@pytest.mark.parametrize("kind,match", [(LegacyCacheLlama, "fails when given a transformers Cache .*not subscriptable"),
                                        (TupleLlama, "returns a tuple, not a ModelOutput with logits")])
@pytest.mark.parametrize("role", ["model", "draft_model"])
def test_forward_breaking_the_cache_or_output_contract_is_refused_up_front(kind, match, role):
    """A forward that cannot take a transformers Cache, or returns tuples, failed inside the runners' first forward
    (TypeError 'RollbackCache' object is not subscriptable in the model's code; AttributeError: 'tuple' object has no
    attribute 'logits' in the runner): one probe forward names it before anything runs, as target or draft."""
    custom, plain = llama(), llama(layers=1, seed=3)
    custom.__class__ = kind
    target, draft = (custom, plain) if role == "model" else (plain, custom)
    ids, mask = _prompts(2)
    with pytest.raises(ValueError, match=f"{role}: {kind.__name__} cannot be driven .*{kind.__name__}.forward {match}"):
        sk.generate(target, ids, attention_mask=mask, draft_model=draft, max_new_tokens=4, pad_token_id=0)
