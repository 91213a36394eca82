"""Drop-in for Hugging Face ``generate``: same arguments, same output, plus speculation statistics.

    python python/hf_dropin.py [--target DIR --draft DIR]
"""

import torch

import speculative_kernels as sk
from _tiny_pair import pair_from_args, prompts

target, draft, tokenizer = pair_from_args(__doc__)
prompt, _ = prompts(target, tokenizer, 1)

# Greedy: token-identical to target.generate.
expected = target.generate(prompt, max_new_tokens=32, do_sample=False)
output = sk.generate(target, prompt, draft_model=draft, num_speculative_tokens=4, max_new_tokens=32, do_sample=False,
                     return_dict_in_generate=True)
print("greedy identical to model.generate:", torch.equal(output.sequences, expected))
print("stats:", output.speculation_stats.summary())

# Sampling: exactly the target's distribution under temperature / top_k / top_p; torch.manual_seed repeats it.
torch.manual_seed(0)
sampled = sk.generate(target, prompt, assistant_model=draft, do_sample=True, temperature=0.8, top_p=0.95,
                      max_new_tokens=32)
print("sampled:", sampled[0, prompt.shape[1]:].tolist())

# Batches with left padding work too (HF's assisted generation refuses batch > 1).
batch, mask = prompts(target, tokenizer, 3)
out = sk.generate(target, batch, attention_mask=mask, draft_model=draft, max_new_tokens=16, do_sample=False)
print("batched identical:", torch.equal(out, target.generate(batch, attention_mask=mask, max_new_tokens=16,
                                                             do_sample=False)))
