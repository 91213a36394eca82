"""What ``generate`` returns with ``return_dict_in_generate=True``: HF's output classes plus the statistics."""

import dataclasses

from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from .stats import SpeculationStats


@dataclasses.dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus ``speculation_stats``. Its cache field (``cache`` from transformers 5.24,
    ``past_key_values`` before) is None: the caches hold rolled-back holes and are not meant for reuse."""

    speculation_stats: SpeculationStats | None = None


@dataclasses.dataclass
class SpeculativeEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """``GenerateEncoderDecoderOutput`` plus ``speculation_stats``; ``sequences`` are the decoder's, as in HF."""

    speculation_stats: SpeculationStats | None = None
