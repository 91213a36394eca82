"""Per-row settings of a batch whose rows are separate requests (``SpeculativeDecoder.add_request``): each row's
length limit, EOS ids, sampling parameters and random-number key and offsets. With them a row's output depends only
on its own settings and seed, never on its batch-mates."""

import dataclasses

import torch

from ..ops.sampling import Sampling
from ..ops.validation import check_sampling


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """One entry per row. max_new_tokens: tokens the row may still generate (>= 1); eos: the row's EOS ids;
    temperature (0: greedy), top_k (0: off), top_p (1: off): validated by the caller; min_new_tokens: tokens the row
    must still generate before its EOS may come (EOS masked until then, as HF's MinNewTokensLength); keys: the rows' Philox keys
    (``randomness.request_key``); draft_offsets, verify_offsets: the rows' random-number counters so far (0 for a
    new request). Optional (None: none for any row): processors, each row's HF logits-processor list (``[]``: none;
    ``context_processors.py``), built for the request alone; warpers, each row's HF warper chain (``Warpers``) or
    None (a row with one samples with neutral temperature/top_k/top_p: the chain applies its own); prompt_lengths,
    each row's own prompt length (the processors read the row's own tokens, not the batch's left padding)."""

    max_new_tokens: list[int]
    eos: list[frozenset]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_new_tokens: list[int]
    keys: list[int]
    draft_offsets: list[int]
    verify_offsets: list[int]
    processors: list | None = None
    warpers: list | None = None
    prompt_lengths: list[int] | None = None

    def __post_init__(self):
        sizes = {len(getattr(self, field.name)) for field in dataclasses.fields(self)
                 if getattr(self, field.name) is not None}
        if len(sizes) != 1:
            raise ValueError(f"RowSettings fields must have one entry per row, got lengths {sorted(sizes)}")

    @property
    def batch(self) -> int:
        return len(self.max_new_tokens)

    def sampling(self, device: torch.device) -> Sampling:
        """The rows' ``Sampling`` (``RowSampling``: [B] tensors on device, with the host bound of the sampled rows'
        top_k when every sampled row with top_p < 1 has a top_k: ``RowSampling.top_k_bound``)."""
        sampling = check_sampling(torch.tensor(self.temperature, dtype=torch.float32, device=device),
                                  torch.tensor(self.top_k, dtype=torch.int64, device=device),
                                  torch.tensor(self.top_p, dtype=torch.float64, device=device), self.batch, device)
        sampled = [(k, p) for t, k, p in zip(self.temperature, self.top_k, self.top_p) if t > 0]
        if all(k > 0 for k, p in sampled if p < 1.0):
            bound = max((k for k, _ in sampled), default=0)
            sampling = dataclasses.replace(sampling, rows=dataclasses.replace(sampling.rows, top_k_bound=bound))
        return sampling
