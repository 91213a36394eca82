"""Driving the decoder from a serving loop: one iteration at a time, text streamed per request.

    python python/serving_loop.py [--target DIR --draft DIR]

Without folders it uses the bundled demo pair (which has a tokenizer). Each request's new tokens go to its own
``IncrementalDetokenizer``, whose pieces join to exactly ``tokenizer.decode`` of the request's tokens; ``seed=``
makes the batch repeatable without touching torch's global generator.
"""

import argparse

import torch

from speculative_kernels import IncrementalDetokenizer, SpeculativeDecoder
from speculative_kernels.demo_pair import demo_model_paths
from speculative_kernels.model_loading import load_model

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--target", help="local HF folder with a tokenizer (default: the bundled demo target)")
parser.add_argument("--draft", help="local HF folder (default: the bundled demo draft)")
args = parser.parse_args()
if bool(args.target) != bool(args.draft):
    parser.error("give both --target and --draft, or neither")
target_dir, draft_dir = (args.target, args.draft) if args.target else demo_model_paths()
target, tokenizer = load_model(target_dir, dtype="float32")
draft, _ = load_model(draft_dir, dtype="float32")
decoder = SpeculativeDecoder(target, draft, num_speculative_tokens=4)

requests = {"req-a": "def fibonacci(n):", "req-b": "import os\n\nclass Config:", "req-c": "for line in"}
tokenizer.padding_side = "left"
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
tokenizer.pad_token_id = pad
encoded = tokenizer(list(requests.values()), return_tensors="pt", padding=True)

session = decoder.start(encoded["input_ids"], attention_mask=encoded["attention_mask"], max_new_tokens=32,
                        do_sample=True, temperature=0.7, pad_token_id=pad, seed=1234)
streams = {name: IncrementalDetokenizer(tokenizer, skip_special_tokens=True) for name in requests}
texts = {name: "" for name in requests}
while not session.finished:
    for name, tokens in zip(requests, session.step()):  # one draft + verify iteration, one host read
        piece = streams[name].push(tokens)  # "" while a character or word is incomplete
        texts[name] += piece                # a server would send the piece to the request's client here
for name, prompt in requests.items():
    texts[name] += streams[name].flush()
    print(f"{name}: {prompt!r} -> {texts[name]!r}")
print(f"{session.iterations} iterations; {session.stats.summary()}")
