"""Models dispatched by accelerate with offloaded weights (``from_pretrained(device_map=..., offload_folder=...)``):
parameters on the meta device, loaded by hooks for each forward. The device they run on is the hooks'."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import speculative_kernels as sk
from helpers.models import llama

pytest.importorskip("accelerate")


def test_disk_offloaded_embeddings_generate_as_hf(tmp_path):
    """The first parameter (the embedding) offloaded to disk: its device reads "meta", which was taken for the
    model's device (a refusal, "model is on meta but draft_model is on cpu")."""
    llama(layers=3).save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                                  offload_folder=str(tmp_path / "offload")).eval()
    assert next(target.parameters()).device.type == "meta"
    draft = llama(layers=1, seed=5)
    ids = torch.tensor([[5, 17, 42, 70, 7]])
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    for cache in ("dynamic", "static"):
        got = sk.generate(target, ids, draft_model=draft, max_new_tokens=8, do_sample=False,
                          cache_implementation=cache)
        assert torch.equal(got, expected), cache
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    request = decoder.add_request(ids[0].tolist(), max_new_tokens=8)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(request).token_ids == expected[0, 5:].tolist()
