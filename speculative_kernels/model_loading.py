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


def is_encoder_decoder(path: str | Path, trust_remote_code: bool = False) -> bool:
    from transformers import AutoConfig

    return bool(AutoConfig.from_pretrained(path, local_files_only=True,
                                           trust_remote_code=trust_remote_code).is_encoder_decoder)


def load_model(path: str | Path, *, device: str = "cpu", dtype: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer) from a local HF folder; AutoModelForSeq2SeqLM for encoder-decoder configs, else
    AutoModelForCausalLM. The tokenizer is None when the folder has none."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    auto = AutoModelForSeq2SeqLM if is_encoder_decoder(path, trust_remote_code) else AutoModelForCausalLM
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
