"""The decode loop reads the device at most once per iteration (checked by intercepting host-reading calls)."""

import pytest
import torch

import speculative_kernels as sk
from helpers.host_reads import step_reading_once
from helpers.models import llama


def _session(batch, device="cpu", backend="auto", **kwargs):
    target, draft = llama().to(device), llama(layers=1, seed=4).to(device)
    ids = torch.randint(3, 97, (batch, 6), generator=torch.Generator().manual_seed(0)).to(device)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3, backend=backend)
    return decoder.start(ids, max_new_tokens=20, pad_token_id=0, **kwargs)


def test_one_host_read_per_iteration_greedy_and_sampling():
    _check_one_read_per_iteration()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_one_host_read_per_iteration_with_gpu_kernels(backend):
    """The same count with the kernels doing the verification and the draft sampling on a GPU."""
    _check_one_read_per_iteration(device="cuda", backend=backend)


def _check_one_read_per_iteration(**session_kwargs):
    # (the third: HF's processors over the whole block, ``block_processors.py``, the rows at different lengths)
    for batch, kwargs in ((1, dict(do_sample=False)), (4, dict(do_sample=True, temperature=0.8, top_k=10,
                                                                 top_p=0.9, min_new_tokens=5)),
                          (4, dict(do_sample=False, repetition_penalty=1.2, no_repeat_ngram_size=2, min_new_tokens=5,
                                   eos_token_id=2, suppress_tokens=[7]))):
        session = _session(batch, **session_kwargs, **kwargs)
        steps = step_reading_once(session)
        assert steps > 1
