"""What the static caches' memory check counts for HF's vision and speech encoder-decoder wrappers at realistic
shapes (random weights from default configs; nothing downloaded). ~1-2 min on a CPU.

    python benchmarks/wrapper_memory_check.py vit-gpt2        # ViT-B/16 at 224 px + GPT-2 (S = 197)
    python benchmarks/wrapper_memory_check.py wav2vec2-bert   # Wav2Vec2-base + BERT-base, 30 s of 16 kHz audio

Prints the parts (MiB) of the one check a ``generate(..., cache_implementation="static")`` call makes (batch 1, the
target as its own draft, gamma 5, 64 new tokens): before the source's length was read off the encoder's output,
vision and speech sources counted only ``kv_caches``, ``slot_masks`` and ``attention_mask``.
"""

import sys
import time

import torch
from transformers import (BertConfig, GPT2Config, SpeechEncoderDecoderConfig, SpeechEncoderDecoderModel, ViTConfig,
                          VisionEncoderDecoderConfig, VisionEncoderDecoderModel, Wav2Vec2Config)

import speculative_kernels as sk
from speculative_kernels.generation.runners import factory


def build(which: str):
    """(model, source, keywords) for ``which``."""
    torch.manual_seed(0)
    if which == "vit-gpt2":
        decoder = GPT2Config(add_cross_attention=True, is_decoder=True)
        config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), decoder)
        return VisionEncoderDecoderModel(config=config).eval(), torch.randn(1, 3, 224, 224), {}
    decoder = BertConfig(is_decoder=True, add_cross_attention=True)
    config = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(Wav2Vec2Config(), decoder)
    samples = 30 * 16000
    return (SpeechEncoderDecoderModel(config=config).eval(), torch.randn(1, samples),
            {"attention_mask": torch.ones(1, samples, dtype=torch.int64)})


def main(which: str) -> None:
    seen = []
    factory.check_free_memory = lambda required, *args, **kwargs: seen.append(required)  # record, never refuse
    model, source, kwargs = build(which)
    for config in (model.config, model.generation_config):
        config.decoder_start_token_id, config.pad_token_id = 0, 1
    model.generation_config.eos_token_id = None  # (64 tokens whatever the random weights say)
    start = time.perf_counter()
    sk.generate(model, source, **kwargs, draft_model=model, num_speculative_tokens=5, do_sample=False,
                max_new_tokens=64, cache_implementation="static")
    (required,) = seen
    parts = {name: round(value / 2**20, 2) for name, value in required.items()}
    print(f"{which} (torch {torch.__version__}): {parts} MiB; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vit-gpt2")
