"""What ``generate`` returns with ``return_dict_in_generate=True``: HF's output classes plus the statistics."""

import dataclasses

from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from .stats import SpeculationStats


@dataclasses.dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``speculation_stats``. Its cache field (``cache`` from transformers 5.24,
    ``past_key_values`` before; ``cache_field``) is the caller's prompt cache where the call extended it (the same
    object, as HF returns it), else None: our own caches hold rolled-back holes and are not meant for reuse."""

    speculation_stats: SpeculationStats | None = None


@dataclasses.dataclass
class SpeculativeEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """``GenerateEncoderDecoderOutput`` plus ``speculation_stats``; ``sequences`` are the decoder's, as in HF."""

    speculation_stats: SpeculationStats | None = None


def cache_field(output_class) -> str:
    """The name of an output class's cache field: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    names = {field.name for field in dataclasses.fields(output_class)}
    return "cache" if "cache" in names else "past_key_values"
