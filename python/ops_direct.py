"""Calling the ops directly: the verification step and the draft sampler, with explicit randomness.

    python python/ops_direct.py
"""

import torch

from speculative_kernels import ops

batch, gamma, vocab = 2, 4, 32000
target_logits = torch.randn(batch, gamma + 1, vocab)  # [B, K+1, V]: the target's forward over [last, x_1..x_K]
draft_logits = torch.randn(batch, gamma, vocab)  # [B, K, V]: what the draft sampled x_1..x_K from

# The draft side: one token per row from softmax(warp(logits)), Philox noise from (seed, offset).
draft_tokens = torch.stack(
    [ops.sample(draft_logits[:, i], temperature=0.8, top_k=50, seed=1234, offset=i) for i in range(gamma)], dim=1
)

# The verification step: accept/reject, residual or bonus token. Same seed + offset -> same result.
tokens, num_accepted = ops.verify(target_logits, draft_logits, draft_tokens, temperature=0.8, top_k=50,
                                  seed=1234, offset=0)
print("emitted tokens (-1 = padding):", tokens.tolist())
print("accepted per row:", num_accepted.tolist())

# Greedy verification and a drafter without a distribution (n-gram style, one-hot q).
tokens, num_accepted = ops.verify(target_logits, None, draft_tokens, temperature=0.0)
print("greedy:", tokens.tolist(), num_accepted.tolist())

# Backends: "torch" (reference, any device), "triton" and "cuda" (GPU), "auto" picks the best available.
tokens, _ = ops.verify(target_logits, draft_logits, draft_tokens, temperature=0.8, seed=7, backend="torch")
print("backend torch:", tokens.tolist())
