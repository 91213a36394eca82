"""Checks that need a CUDA device, shared by the Triton and CUDA op tests."""

import torch

from speculative_kernels import ops


def assert_seed_none_is_captured(backend: str, device: str = "cuda") -> None:
    """seed=None while capturing a CUDA graph: the seed is drawn on the device, so it is captured (no host copy
    from pageable memory inside the capture) and every replay draws a fresh one (a seed baked into the graph would
    repeat the tokens). Uniform logits: the tokens depend on the random numbers only."""
    batch, k, vocab = 64, 2, 1000
    target = torch.zeros(batch, k + 1, vocab, device=device)
    tokens = torch.zeros(batch, k, dtype=torch.int64, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.verify(target, None, tokens, temperature=1.0, backend=backend)  # compiles / loads outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, n = ops.verify(target, None, tokens, temperature=1.0, backend=backend)
    graph.replay()
    first = out.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert ((n >= 0) & (n <= k)).all()
    assert not torch.equal(out, first)
