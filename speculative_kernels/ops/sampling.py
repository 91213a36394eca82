"""``Sampling``: how a token is chosen (greedy, or HF's warpers), as the Python backends take it."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean off (HF's TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper, in that order). Validated by ``validation.check_sampling_params``."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def cuts(self, vocab: int) -> bool:
        """Whether top-k / top-p can remove tokens from a vocabulary of ``vocab`` when sampling."""
        return not self.greedy and (0 < self.top_k < vocab or self.top_p < 1.0)


GREEDY = Sampling(0.0, 0, 1.0)
