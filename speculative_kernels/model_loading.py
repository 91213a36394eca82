"""Loading users' checkpoints from local paths (offline: nothing is fetched)."""

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """'bf16' -> torch.bfloat16; None or 'auto' -> None (the checkpoint's own dtype)."""
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}")
    return DTYPES[name]


def auto_model_class(path: str | Path, trust_remote_code: bool = False):
    """The transformers auto class that loads the checkpoint for generation: AutoModelForSeq2SeqLM for an
    encoder-decoder config, AutoModelForImageTextToText for an image-text-to-text one that no causal-LM mapping
    lists (Qwen2-VL, LLaVA, PaliGemma, ...: they generate from text too), else AutoModelForCausalLM."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if config.is_encoder_decoder:
        return transformers.AutoModelForSeq2SeqLM
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_model(path: str | Path, *, device: str = "cpu", dtype: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer) from a local HF folder, with ``auto_model_class``'s class. The tokenizer is None when the
    folder has none."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    auto = auto_model_class(path, trust_remote_code)
    kwargs = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    torch_dtype = parse_dtype(dtype)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    model = auto.from_pretrained(path, **kwargs).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer
