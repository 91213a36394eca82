"""``Sampling``: how a token is chosen (greedy, or HF's warpers), as the Python backends take it."""

import dataclasses

import torch

# The kernels divide float32 logits by float32(temperature): below float32's smallest normal number the divisor is
# subnormal (or zero) and every logit of ordinary size overflows, so such a temperature is refused.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny
# Above float32's largest value the temperature is infinite in float32, in which the kernels hold it, so such a
# temperature is refused by name too (HF's float32 division by it gives 0 for every logit: a uniform draw).
MAX_TEMPERATURE = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity: tensors have no boolean ==
class RowSampling:
    """Per-row sampling parameters, on the op's device (validated by ``validation.check_row_sampling``).

    temperature: [B] float32 (0 means greedy for that row); top_k: [B] int64 (0 means off); top_p: [B] float64
    (1 means off; float64 so that a row's threshold 1 - top_p rounds exactly as the scalar path's python float).
    ``cut``: whether any row may apply top-k / top-p (False when both were given as scalars that switch them off),
    a static fact, so no device value is read to decide it. ``given_temperature``: the caller's float64 temperature
    tensor (None otherwise), read only to name a refused value in the error (1e39, infinite in float32).
    ``top_k_bound``: a host int >= every sampled row's top_k such that every sampled row with top_p < 1 has
    top_k > 0, known from host values (``RowSettings.sampling``), or None: the cut then takes one topk of the bound
    instead of a V-length sort per row (``warping.row_thresholds``).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    cut: bool
    given_temperature: torch.Tensor | None = None
    top_k_bound: int | None = None

    def select(self, index: torch.Tensor) -> "RowSampling":
        """The rows at ``index`` [n] int64 (a bound over a superset of rows stays a bound)."""
        return RowSampling(self.temperature.index_select(0, index), self.top_k.index_select(0, index),
                           self.top_p.index_select(0, index), self.cut, top_k_bound=self.top_k_bound)

    def join(self, other: "RowSampling") -> "RowSampling":
        """These rows, then ``other``'s."""
        bounds = (self.top_k_bound, other.top_k_bound)
        return RowSampling(torch.cat([self.temperature, other.temperature]), torch.cat([self.top_k, other.top_k]),
                           torch.cat([self.top_p, other.top_p]), self.cut or other.cut,
                           top_k_bound=None if None in bounds else max(bounds))

    @property
    def greedy(self) -> torch.Tensor:
        """[B] bool: rows decoded greedily."""
        return self.temperature == 0.0

    def safe_temperature(self) -> torch.Tensor:
        """[B] float32: the temperature, 1 for greedy rows (whose logits are then used as they are)."""
        return torch.where(self.greedy, torch.ones_like(self.temperature), self.temperature)

    def sampled_top_k(self) -> torch.Tensor:
        """[B] int64: top_k for sampled rows, 0 (off) for greedy rows (a cut cannot change an argmax)."""
        return torch.where(self.greedy, torch.zeros_like(self.top_k), self.top_k)

    def sampled_top_p(self) -> torch.Tensor:
        """[B] float64: top_p for sampled rows, 1 (off) for greedy rows."""
        return torch.where(self.greedy, torch.ones_like(self.top_p), self.top_p)

    def breaks_top_k_bound(self) -> torch.Tensor:
        """[B] bool: sampled rows that break ``top_k_bound`` (top_k above it, or top-p without a top_k); all False
        without a bound. The cut from one topk of the bound would be wrong there. A bound past int64 bounds every
        int64 top_k (compared as it is, torch would wrap 2**63 to a negative int64, or overflow)."""
        if self.top_k_bound is None:
            return torch.zeros_like(self.top_k, dtype=torch.bool)
        k = self.top_k
        bound = min(self.top_k_bound, torch.iinfo(torch.int64).max)
        return ~self.greedy & ((k > bound) | ((k <= 0) & (self.top_p < 1.0)))

    def out_of_range(self) -> torch.Tensor:
        """[B] bool on the rows' device: True where a parameter is invalid (no host read). Such rows come back
        flagged (-1) from every backend; ``diagnostics.raise_for_invalid_rows`` names the argument."""
        t = self.temperature
        bad_t = ~(t >= 0.0) | (t == float("inf")) | ((t > 0.0) & (t < MIN_TEMPERATURE))
        return bad_t | (self.top_k < 0) | ~((self.top_p > 0.0) & (self.top_p <= 1.0))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean off (HF's TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper, in that order). Validated by ``validation.check_sampling_params``.

    ``rows``: per-row parameters (``RowSampling``); when set, they replace the three scalars for every row."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    rows: RowSampling | None = None

    @property
    def per_row(self) -> bool:
        return self.rows is not None

    @property
    def greedy(self) -> bool:
        """Every row greedy (known without reading a device value; False with per-row parameters)."""
        return self.rows is None and self.temperature == 0.0

    def cuts(self, vocab: int) -> bool:
        """Whether top-k / top-p can remove tokens from a vocabulary of ``vocab`` when sampling."""
        if self.rows is not None:
            return self.rows.cut
        return not self.greedy and (0 < self.top_k < vocab or self.top_p < 1.0)

    def top_k_alone(self, vocab: int) -> bool:
        """One temperature and top-k as the only cut (0 < top_k < vocab, top_p off): the cut's element is then
        ``warping.kth_largest_index`` of the raw logits."""
        return self.rows is None and self.top_p >= 1.0 and 0 < self.top_k < vocab

    def top_k_with_top_p(self, vocab: int) -> bool:
        """One temperature, sampled, with top-k (0 < top_k < vocab) and top-p (< 1): ``warping.warp_thresholds`` then
        sorts only the k candidates, and its cut is an element of the vocabulary."""
        return self.rows is None and not self.greedy and self.top_p < 1.0 and 0 < self.top_k < vocab


GREEDY = Sampling(0.0, 0, 1.0)
