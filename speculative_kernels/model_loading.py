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


def adapter_base(path: str | Path) -> str | None:
    """The base model that a PEFT adapter folder (adapter_config.json, no config.json) names in its
    adapter_config.json (``base_model_name_or_path``), which ``from_pretrained(path)`` loads the adapter onto
    (transformers' PEFT integration); None for any other folder. A ValueError naming the folder where the adapter
    cannot be loaded that way (no base named, or peft not installed)."""
    import json

    from transformers.utils import is_peft_available

    path = Path(path)
    if (path / "config.json").is_file() or not (path / "adapter_config.json").is_file():
        return None
    try:
        base = json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: its adapter_config.json cannot be read ({exc})") from None
    if not base:
        raise ValueError(f"{path} is a PEFT adapter folder (adapter_config.json, no config.json) that names no base "
                         "model (base_model_name_or_path): set it to the base model's folder, or pass a merged "
                         "checkpoint's folder")
    if not is_peft_available():
        raise ValueError(f"{path} is a PEFT adapter folder (adapter_config.json, no config.json): loading it onto its "
                         f"base model {base} needs the peft package (pip install peft)")
    return str(base)


def _base_config(path: Path, base: str, trust_remote_code: bool):
    """The config of adapter folder ``path``'s base model ``base``, from local files only; an error naming both where
    it cannot be found or read."""
    import transformers

    where = (f"{path} is a PEFT adapter folder (adapter_config.json, no config.json) whose base model {base!r} "
             "(base_model_name_or_path in its adapter_config.json)")
    try:
        return transformers.AutoConfig.from_pretrained(base, local_files_only=True,
                                                       trust_remote_code=trust_remote_code)
    except OSError as exc:
        detail = f": {exc}" if Path(base).is_dir() else ""  # (else HF's words are about Hub repo ids)
        raise FileNotFoundError(f"{where} cannot be found: it is neither a folder here nor a model in the local "
                                f"Hugging Face cache (nothing is downloaded){detail}") from None
    except ValueError as exc:
        raise ValueError(f"{where} cannot be loaded: {exc}") from None


def auto_model_class(path: str | Path, trust_remote_code: bool = False):
    """The transformers auto class that loads the checkpoint for generation: AutoModelForSeq2SeqLM for an
    encoder-decoder config, AutoModelForImageTextToText for an image-text-to-text one that no causal-LM mapping
    lists (Qwen2-VL, LLaVA, PaliGemma, ...: they generate from text too), else AutoModelForCausalLM. A PEFT adapter
    folder's class is its base model's (``adapter_base``), as ``from_pretrained`` picks it."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    base = adapter_base(path)
    if base is not None:
        config = _base_config(Path(path), base, trust_remote_code)
    else:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True,
                                                         trust_remote_code=trust_remote_code)
    if config.is_encoder_decoder:
        return transformers.AutoModelForSeq2SeqLM
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_model(path: str | Path, *, device: str = "cpu", dtype: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer) from a local HF folder, with ``auto_model_class``'s class. A PEFT adapter folder loads as
    ``from_pretrained`` loads it: its base model with the adapter (transformers' PEFT integration), and the base's
    tokenizer where the adapter folder has none. The tokenizer is None when the folder (and its base) has none."""
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
    base = adapter_base(path)
    tokenizer = None
    for folder in (path,) if base is None else (path, base):
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
            break
        except (OSError, ValueError):
            continue
    return model, tokenizer
