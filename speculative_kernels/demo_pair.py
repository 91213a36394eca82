"""The small target/draft model pair shipped with the package (``speculative_kernels/demo_models/``).

Two Llama-style models trained on the Python standard library's source code by ``benchmarks/train_demo_pair.py``:
a 12-layer target and a 1-layer draft distilled from it, sharing one byte-level BPE tokenizer. See
``demo_models/README.md`` for how they were made and what they measure.

The weights are stored as fp16. transformers 5 loads them in their stored dtype by default, which is slow on CPU, so
pass ``dtype=torch.float32`` there (or use :func:`load_demo_pair`).
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODELS_DIR = Path(__file__).resolve().parent / "demo_models"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_model_paths() -> tuple[Path, Path]:
    """Return ``(target_dir, draft_dir)``, the two HF model folders of the shipped demo pair.

    Each loads offline with ``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``.
    Raises ``FileNotFoundError`` when the folders or their files are missing (e.g. a checkout without them).
    """
    target, draft = DEMO_MODELS_DIR / "target", DEMO_MODELS_DIR / "draft"
    missing = [str(d / f) for d in (target, draft) for f in _REQUIRED if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(
            "the demo target/draft models are missing from this installation of speculative_kernels "
            f"(expected under {DEMO_MODELS_DIR}; missing: {', '.join(missing)}). Reinstall the package, or recreate "
            f"them with `python benchmarks/train_demo_pair.py --out {DEMO_MODELS_DIR}` from a source checkout."
        )
    return target, draft


def load_demo_pair(dtype=None, device=None):
    """Load ``(target, draft, tokenizer)`` from :func:`demo_model_paths` (fp32 on CPU unless ``dtype`` is given)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = demo_model_paths()
    dtype = dtype if dtype is not None else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    if device is not None:
        target, draft = target.to(device), draft.to(device)
    return target, draft, AutoTokenizer.from_pretrained(target_dir)


__all__ = ["DEMO_MODELS_DIR", "demo_model_paths", "load_demo_pair"]
