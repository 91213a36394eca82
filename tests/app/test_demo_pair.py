"""The shipped demo target/draft pair: present, loadable offline, consistent with each other."""

import json

import pytest
import torch

from speculative_kernels.demo_pair import demo_model_paths, load_demo_pair

SNIPPET = 'def greet(name: str) -> str:\n    """Say hi."""\n\treturn f"héllo, {name}!"  # ünïcode ✓\n\n'


@pytest.fixture(scope="module")
def pair():
    return load_demo_pair()


def test_paths_are_hf_folders():
    target_dir, draft_dir = demo_model_paths()
    for d in (target_dir, draft_dir):
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
            assert (d / f).is_file(), d / f
        gen = json.loads((d / "generation_config.json").read_text())
        assert gen["eos_token_id"] is not None and gen["bos_token_id"] is not None and gen["pad_token_id"] is not None
        assert not gen.get("do_sample", False)
        assert "max_length" not in gen  # the caller sets the length (HF warns when both are set)
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] and cfg["max_position_embeddings"] >= 256
    size = sum(f.stat().st_size for d in (target_dir, draft_dir) for f in d.iterdir())
    assert size < 30e6, f"demo models take {size / 1e6:.1f} MB"


def test_missing_dir_raises(monkeypatch, tmp_path):
    import speculative_kernels.demo_pair as dp

    monkeypatch.setattr(dp, "DEMO_MODELS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="demo"):
        dp.demo_model_paths()


def test_shared_tokenizer_and_vocab(pair):
    from transformers import AutoTokenizer

    target, draft, tok = pair
    target_dir, draft_dir = demo_model_paths()
    tok_d = AutoTokenizer.from_pretrained(draft_dir)
    assert tok.get_vocab() == tok_d.get_vocab()
    assert target.config.vocab_size == draft.config.vocab_size == len(tok)
    assert target.get_input_embeddings().weight.shape[0] == draft.get_input_embeddings().weight.shape[0]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(tok, name) == getattr(target.config, name) == getattr(draft.config, name)
    ids = tok(SNIPPET)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == SNIPPET
    assert tok_d(SNIPPET)["input_ids"] == ids


def test_finite_logits_and_draft_is_smaller(pair):
    target, draft, tok = pair
    ids = tok(SNIPPET, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        tl = target(input_ids=ids).logits
        dl = draft(input_ids=ids).logits
    assert tl.shape == dl.shape == (1, ids.shape[1], len(tok))
    assert tl.dtype == dl.dtype == torch.float32
    assert torch.isfinite(tl).all() and torch.isfinite(dl).all()
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    assert n(draft) < n(target)


def test_trained_not_random(pair):
    """A trained target predicts obvious code continuations far better than chance (ln 4096 ~ 8.3 nats)."""
    target, draft, tok = pair
    text = "import os\nimport sys\n\n\ndef main():\n    for i in range(10):\n        print(i)\n    return 0\n"
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        for m in (target, draft):
            loss = m(input_ids=ids, labels=ids).loss.item()
            assert loss < 4.0, loss
