"""A drafter of your own behind the ``Drafter`` protocol: drafts copied from answers given earlier (a response
cache), passed to ``generate(drafter=...)``. No draft model; output exactly the target's.

    python python/own_drafter.py [--target DIR --draft DIR]

A drafter implements ``speculative_kernels.Drafter`` (``generation/drafter.py``): ``start`` (the prompts), ``propose``
(gamma tokens per row; q's logits or None for a proposal without a distribution; per-row counts or None),
``observe`` (the tokens emitted, before the iteration's one host read), ``accept``, ``proposal_counts``,
``select_rows``, ``add_rows`` (rows joining a running batch), ``lengths_to_read``/``lengths_read``, ``forwards``,
``compactions`` (and, optionally, ``READS_EMITTED_TOKENS = True`` with ``emitted_read``: the iteration's emitted
tokens as host lists, from the loop's own read). A proposal without a distribution must be a deterministic function of the row's context (here: the
context and the cache), which makes the one-hot q exact. Everything stays on the device: no ``.item()``/``.tolist()``
in ``propose`` or ``observe``.
"""

import torch

import speculative_kernels as sk
from _tiny_pair import pair_from_args, prompts
from speculative_kernels.ops.lookup import prompt_lookup


class CachedAnswerDrafter:
    """Proposes the continuation of the context's last tokens in earlier answers ([N] token ids), by
    ``ops.prompt_lookup`` over the answers followed by the row's context (both on the device)."""

    def __init__(self, answers: torch.Tensor, max_ngram: int = 3):
        self.answers, self.max_ngram = answers, max_ngram

    def start(self, input_ids, real):
        batch = input_ids.shape[0]
        cache = self.answers.to(input_ids.device).expand(batch, -1)
        order = torch.argsort(real.to(torch.int8), dim=1, stable=True)  # each row's padding first, then its tokens
        context = torch.cat([cache, input_ids.gather(1, order)], dim=1)  # [answers | prompt]; padding only adds windows
        self.used = context.shape[1]  # host bound on every row's length (grows by each iteration's width)
        self.tokens = torch.cat([context, context.new_zeros(batch, 64)], dim=1)
        self.start_at = torch.zeros(batch, dtype=torch.int64, device=input_ids.device)
        self.end = torch.full((batch,), self.used, dtype=torch.int64, device=input_ids.device)

    def propose(self, gamma, choose):
        proposal, count = prompt_lookup(self.tokens, self.start_at, self.end, num_tokens=gamma,
                                        max_ngram=self.max_ngram)
        return proposal, None, count  # no distribution (one-hot q); count: each row's real proposals

    def observe(self, out, accepted, finished):
        count = sk.emitted_counts(accepted, finished)  # [B]: how many of out each row emitted
        width = out.shape[1]
        if self.used + width > self.tokens.shape[1]:  # double the buffer (host values only)
            self.tokens = torch.cat([self.tokens, torch.zeros_like(self.tokens)], dim=1)
        positions = torch.arange(width, device=out.device)
        index = self.end.unsqueeze(1) + positions
        keep = positions < count.unsqueeze(1)
        self.tokens.scatter_(1, index, torch.where(keep, out, self.tokens.gather(1, index)))
        self.end = self.end + count
        self.used += width

    def accept(self, draft_tokens, accepted, accepted_host, next_token, finished):
        pass  # nothing to roll back: observe appended exactly what was emitted

    def proposal_counts(self):
        return None  # unknown on the host: the loop drafts the full gamma every iteration

    def select_rows(self, index):
        self.tokens, self.start_at, self.end = (t.index_select(0, index) for t in (self.tokens, self.start_at,
                                                                                   self.end))

    def add_rows(self, other):  # rows joining a running batch (SpeculativeDecoder.add_request): other's after ours
        width = max(self.tokens.shape[1], other.tokens.shape[1])
        tokens = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (self.tokens, other.tokens)]
        self.tokens = torch.cat(tokens)
        self.start_at, self.end = torch.cat([self.start_at, other.start_at]), torch.cat([self.end, other.end])
        self.used = max(self.used, other.used)

    def lengths_to_read(self):
        return None

    def lengths_read(self, lengths):
        pass

    forwards = 0
    compactions = 0


target, _, tokenizer = pair_from_args(__doc__)
kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
prompt, _ = prompts(target, tokenizer, 1)
earlier = target.generate(prompt, **kwargs)[0, prompt.shape[1]:]  # an answer given before, now in the cache

expected = target.generate(prompt, **kwargs)
stats = sk.SpeculationStats()
output = sk.generate(target, prompt, drafter=CachedAnswerDrafter(earlier), num_speculative_tokens=8,
                     speculation_stats=stats, **kwargs)
print("greedy identical to model.generate:", torch.equal(output, expected))
print(f"{stats.new_tokens} tokens in {stats.target_forwards} target forwards "
      f"({stats.accepted_tokens} drafts accepted of {stats.drafted_tokens})")

torch.manual_seed(0)
sampled = sk.generate(target, prompt, drafter=CachedAnswerDrafter(earlier), num_speculative_tokens=8,
                      do_sample=True, temperature=0.7, max_new_tokens=24, eos_token_id=None)
print("sampled (exactly the target's distribution):", sampled[0, prompt.shape[1]:].tolist())
