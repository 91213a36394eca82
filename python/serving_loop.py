"""Driving the decoder from a serving loop: one iteration at a time, tokens streamed per request.

    python python/serving_loop.py [--target DIR --draft DIR]
"""

import torch

from speculative_kernels import SpeculativeDecoder
from _tiny_pair import pair_from_args

target, draft = pair_from_args(__doc__)
decoder = SpeculativeDecoder(target, draft, num_speculative_tokens=4)

requests = {"req-a": [1, 5, 9, 4], "req-b": [1, 30, 2, 8, 8, 3], "req-c": [1, 77]}
width = max(len(p) for p in requests.values())
input_ids = torch.tensor([[0] * (width - len(p)) + p for p in requests.values()])  # left padding
attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in requests.values()])

session = decoder.start(input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=True,
                        temperature=0.7, pad_token_id=0)
streams = {name: [] for name in requests}
while not session.finished:
    for name, tokens in zip(requests, session.step()):  # one draft + verify iteration, one host read
        streams[name].extend(tokens)
for name, tokens in streams.items():
    print(f"{name}: {tokens}")
print(f"{session.iterations} iterations; {session.stats.summary()}")
