"""Where random numbers come from: seeds, offsets and per-row Philox keys (the bits themselves: ``philox.py``).

An op's draws are keyed by (seed, offset, row, element) and a stream id (``philox.py``'s counter layout). Seeds and
offsets follow one rule whether they are ints or tensors: seed in [0, 2**63), offset in [0, 2**32). Ints and CPU
tensors are checked on entry (``resolve_randomness``); a tensor on another device is checked with the op's result
(``diagnostics.raise_for_invalid_rows``, in the one host read that ``check=True`` makes anyway), so checking adds no
host synchronisation; unchecked (inside ``torch.compile`` or a CUDA graph) nothing is read and such a value is used as
its low bits.
"""

import dataclasses
import numbers

import torch
from torch._subclasses.fake_tensor import is_fake

from .philox import STREAM_ROW_KEY, philox_first_word

MAX_OFFSET = 2**32
MAX_SEED = 2**63
_LIMITS = {"seed": (MAX_SEED, "2**63"), "offset": (MAX_OFFSET, "2**32")}


@dataclasses.dataclass(frozen=True)
class Randomness:
    """The Philox inputs of one op call, as the Python backends take them.

    seed, offset: [B] int64 on the op's device (a key and a step counter per row); seed_per_row: True when the seeds
    are the rows' own keys, so the counter's row word is 0 and a row's numbers do not depend on its batch position.
    """

    seed: torch.Tensor
    offset: torch.Tensor
    seed_per_row: bool = False

    def out_of_range(self) -> torch.Tensor:
        """[B] bool on the rows' device: True where the seed or the offset is outside its range (no host read)."""
        return (self.seed < 0) | (self.offset < 0) | (self.offset >= MAX_OFFSET)


def _range_error(name: str, value) -> ValueError:
    return ValueError(f"{name} must be in [0, {_LIMITS[name][1]}), got {value}")


def _as_row_tensor(name: str, value, batch: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """int or int64 tensor of shape [], [1] or [B] -> ([B] int64 on device, whether it was given per row).
    Ints and CPU tensors are range-checked here (see the module docstring)."""
    limit = _LIMITS[name][0]
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} tensor must be int64 or int32, got {value.dtype}")
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] not in (1, batch)):
            raise ValueError(f"{name} must be a scalar, shape [1] or shape [{batch}], got {tuple(value.shape)}")
        if value.device.type == "cpu" and value.numel() and not torch.compiler.is_compiling() and not (
                is_fake(value) or (0 <= int(value.min()) and int(value.max()) < limit)):
            too_large = value >= limit if limit <= torch.iinfo(torch.int64).max else torch.zeros_like(value, dtype=bool)
            bad = value[(value < 0) | too_large].flatten()[0]  # (an int64 compared with 2**63 is always >= it)
            raise _range_error(name, int(bad))
        per_row = value.dim() == 1 and value.shape[0] == batch and batch > 1
        return value.to(device=device, dtype=torch.int64, non_blocking=True).reshape(-1).expand(batch), per_row
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or an integer tensor, got {type(value).__name__}")
    if not 0 <= value < limit:
        raise _range_error(name, value)
    return torch.full((batch,), int(value), dtype=torch.int64, device=device), False


def resolve_randomness(seed, offset, generator, batch: int, device: torch.device) -> Randomness:
    """Turn (seed | generator, offset) into the ``Randomness`` of ``batch`` rows on ``device``.

    With neither a seed nor a generator, a seed is drawn from torch's default generator of ``device`` (so
    ``torch.manual_seed`` makes runs repeatable). On a GPU that draw is a device op: no host copy, and inside a CUDA
    graph capture it is captured (every replay draws a fresh seed) instead of copying a host value from pageable
    memory. A CUDA generator likewise yields a device tensor: no host synchronisation.
    """
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        seed = torch.randint(0, 2**62, (), generator=generator, device=generator.device)
    elif seed is None:
        seed = torch.randint(0, 2**62, (), device=device)  # on the op's device: capturable by a CUDA graph
    seed_rows, seed_per_row = _as_row_tensor("seed", seed, batch, device)
    offset_rows, _ = _as_row_tensor("offset", offset, batch, device)
    return Randomness(seed_rows, offset_rows, seed_per_row)


def row_keys(seed: torch.Tensor) -> torch.Tensor:
    """One independent 63-bit Philox key per row, from seed [B] and the row index b (a fold-in: two Philox words of
    (seed[b]; b, 0, 0, STREAM_ROW_KEY + {0, 1})). With these as seeds and ``seed_per_row=True`` a row's random
    numbers do not depend on its position in the batch."""
    rows = torch.arange(seed.shape[0], dtype=torch.int64, device=seed.device)
    zero = torch.zeros_like(rows)
    high = philox_first_word(seed, rows, zero, zero, zero + STREAM_ROW_KEY)
    low = philox_first_word(seed, rows, zero, zero, zero + STREAM_ROW_KEY + 1)
    return ((high & 0x7FFFFFFF) << 32) | low


def check_seed(seed) -> int | None:
    """A decoding run's ``seed=`` (``generate``, ``SpeculativeDecoder.start``): None, or an int in [0, 2**63) (not a
    bool). Returns it as a Python int; TypeError / ValueError naming ``seed`` otherwise."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed < MAX_SEED:
        raise _range_error("seed", seed)
    return int(seed)


class DecodeRandomness:
    """The random numbers of one decoding run: the draft sampler's and the verifier's ``Randomness`` per call.

    One seed per run: ``seed`` (an int checked by ``check_seed``), or None to draw one on the device from torch's
    default generator (``resolve_randomness``), so that ``torch.manual_seed`` makes runs repeatable; a given seed
    leaves torch's generators untouched. Row b of the run draws with the key ``row_keys(torch.full((B,), seed))[b]``
    for every batch size B, so no row's numbers depend on the others (rows may leave the batch) and a batch-1 run is
    row 0 of any run with the same seed. The offsets are per-row device counters advanced in place, the draft
    sampler's by one per token the row drafted and the verifier's by one per iteration: no host value enters an
    iteration's random numbers, so its steps can be captured in a CUDA graph as they are.
    """

    def __init__(self, batch: int, device: torch.device, seed: int | None = None, *,
                 keys: torch.Tensor | None = None, offsets: tuple[list[int], list[int]] | None = None):
        if keys is None:
            drawn = resolve_randomness(check_seed(seed), 0, None, batch, device)
            keys = row_keys(drawn.seed)
        elif seed is not None:
            raise ValueError("pass either seed or keys, not both")
        self.seed, self.seed_per_row = keys.to(device=device, dtype=torch.int64), True
        # [B] counters, one per row: a row's offsets count its own draws, so a row joining a running batch (or
        # drafting fewer tokens than its batch-mates) sees the offsets it would see alone.
        draft, verify = offsets if offsets is not None else ([0] * batch, [0] * batch)
        self._draft_offset = torch.tensor(draft, dtype=torch.int64, device=device)
        self._verify_offset = torch.tensor(verify, dtype=torch.int64, device=device)

    def draft(self) -> Randomness:
        """For the next draft sample (advance with ``advance_draft`` after it)."""
        return Randomness(self.seed, self._draft_offset, self.seed_per_row)

    def verify(self) -> Randomness:
        """For the next verification (advance with ``advance_verify`` after it)."""
        return Randomness(self.seed, self._verify_offset, self.seed_per_row)

    def advance_draft(self) -> None:
        self._draft_offset.add_(1)

    def advance_verify(self) -> None:
        self._verify_offset.add_(1)

    def give_back_draft(self, unused: torch.Tensor) -> None:
        """Rows that drafted fewer tokens than the iteration's gamma (their per-row limit) give back the offsets of
        their fillers: unused [B] int64, so a row's draft offset counts only the tokens it drafted for itself."""
        self._draft_offset.sub_(unused)

    def offsets(self) -> tuple[list[int], list[int]]:
        """(draft, verify) offsets of every row, on the host (a device read: between iterations only)."""
        return self._draft_offset.tolist(), self._verify_offset.tolist()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the keys and offsets of rows ``index`` [B'] (finished rows leaving the batch)."""
        self.seed = self.seed.index_select(0, index)
        self._draft_offset = self._draft_offset.index_select(0, index)
        self._verify_offset = self._verify_offset.index_select(0, index)

    def add_rows(self, other: "DecodeRandomness") -> None:
        """Append ``other``'s rows (their keys and offsets) after these: rows joining the batch keep their own."""
        if not (self.seed_per_row and other.seed_per_row):
            raise ValueError("add_rows needs per-row keys on both sides")
        self.seed = torch.cat([self.seed, other.seed])
        self._draft_offset = torch.cat([self._draft_offset, other._draft_offset])
        self._verify_offset = torch.cat([self._verify_offset, other._verify_offset])


def request_key(seed: int) -> int:
    """The Philox key of a request decoded alone with ``seed`` (row 0 of ``row_keys``): its key in any batch, so a
    request's random numbers do not depend on its batch-mates."""
    return int(row_keys(torch.tensor([check_seed(seed)], dtype=torch.int64, device="cpu"))[0])
