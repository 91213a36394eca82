"""The paper's n-gram drafter (Leviathan et al. 2023, section 4: "even simple ones (like n-gram)"; Table 3 reports a
bigram draft for T5-XXL, alpha ~ 0.2): a ``Drafter`` without a network whose q is an n-gram language model over each
row's own context (prompt, generated tokens, the drafts of this iteration) and, optionally, a corpus of the user's.

For draft position i of row b, with context c = the row's tokens so far, P_m (m = 1..order) is the distribution of
the token that followed each earlier occurrence of c's last m - 1 tokens (P_1: the unigram frequencies), and

    q = sum_m w_m P_m / sum_m w_m,   w_m = 4^m over the orders whose context occurred (else 0)

(an interpolation that trusts longer contexts more). q has a distribution, so verification is the usual
sum min(p, q) acceptance. Tokens never seen in the context get a floor of ``Q_FLOOR`` (1e-30) instead of q = 0: they
are drafted only where the target's masks (a minimum length banning EOS, suppressed or forced tokens) ban every token
seen, where an all -inf row would leave nothing to draft. Everything runs on the
device with static shapes per iteration: per order one comparison of every window with the context's suffix and one
scatter-add of the following tokens into [B, V].
"""

import torch

from .context import ContextBuffer
from .drafter import ChooseToken, emitted_counts

# q of a token never seen after the context: far below any count's share (at least 1 / context length), so it is never
# drafted while a seen token is allowed, but a row whose seen tokens are all masked still has a distribution.
Q_FLOOR = 1e-30
# the largest order whose weights 4^m and their sum (< 4^(order + 1) / 3) are finite in float32
MAX_ORDER = 63


def ngram_distribution(tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor, order: int,
                       vocab: int) -> torch.Tensor:
    """q [B, V] float32 (rows sum to 1) of the next token after ``tokens[b, start[b]:end[b]]`` (end > start), by the
    interpolation of the module docstring. tokens: [B, W] int64; start, end: [B] int64."""
    batch, width = tokens.shape
    s = torch.arange(width, device=tokens.device).unsqueeze(0)  # window starts
    start, end = start.unsqueeze(1), end.unsqueeze(1)
    total = torch.zeros(batch, vocab, dtype=torch.float32, device=tokens.device)
    norm = torch.zeros(batch, 1, dtype=torch.float32, device=tokens.device)
    padded = torch.nn.functional.pad(tokens, (0, order))
    for m in range(1, order + 1):
        context = m - 1
        # window s: tokens[s : s + context] equals the context's last `context` tokens; next token at s + context
        ok = (s >= start) & (s + context < end)
        if context:
            suffix = tokens.gather(1, (end - context + torch.arange(context, device=tokens.device)).clamp(min=0))
            for i in range(context):
                ok &= padded[:, i : i + width] == suffix[:, i : i + 1]
        following = padded[:, context : context + width].clamp(0, vocab - 1)
        counts = torch.zeros(batch, vocab, dtype=torch.float32, device=tokens.device)
        counts.scatter_add_(1, following, ok.to(torch.float32))
        seen = counts.sum(dim=1, keepdim=True)
        weight = (seen > 0).to(torch.float32) * float(4**m)  # [B, 1] (float32: never torch's default dtype)
        total += weight * (counts / seen.clamp(min=1))  # (not (weight * counts) / seen: past float32 at m = 63)
        norm += weight
    return total / norm.clamp(min=1e-30)


class NGramDrafter:
    """order: n of the n-gram model (2: the paper's bigram); vocab_size: the width V of the target's logits
    (``for_model`` reads it); corpus: token ids [N] (int64) the counts also come from, or None.

    One drafter object serves one ``generate`` call (``start`` conditions it on that call's prompts).
    """

    def __init__(self, vocab_size: int, order: int = 2, corpus: torch.Tensor | None = None):
        if isinstance(order, bool) or not isinstance(order, int) or order < 1:
            raise ValueError(f"order must be an int >= 1, got {order!r}")
        if order > MAX_ORDER:  # (its weight 4^order is infinite in float32: q was NaN once such a context recurs)
            raise ValueError(f"order must be at most {MAX_ORDER} (the weights 4^m are float32), got {order}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if corpus is not None and (not isinstance(corpus, torch.Tensor) or corpus.dim() != 1
                                   or corpus.is_floating_point() or corpus.is_complex()
                                   or corpus.dtype == torch.bool):
            raise ValueError("corpus must be a 1-D integer tensor of token ids")
        if corpus is not None and corpus.numel() and not 0 <= int(corpus.min()) <= int(corpus.max()) < vocab_size:
            raise ValueError(f"corpus holds token ids outside the vocabulary [0, {vocab_size}): min "
                             f"{int(corpus.min())}, max {int(corpus.max())}")
        self.vocab, self.order, self.corpus = vocab_size, order, corpus
        self.context: ContextBuffer | None = None

    @classmethod
    def for_model(cls, model, order: int = 2, corpus: torch.Tensor | None = None) -> "NGramDrafter":
        """An n-gram drafter for ``model`` (V: the width of its output layer)."""
        head = model.get_output_embeddings()
        vocab = int(head.weight.shape[0]) if head is not None else int(model.config.get_text_config().vocab_size)
        return cls(vocab, order, corpus)

    def start(self, input_ids: torch.Tensor, real: torch.Tensor) -> None:
        prefix = None
        if self.corpus is not None:
            corpus = self.corpus.to(device=input_ids.device, dtype=torch.int64).unsqueeze(0)
            corpus = corpus.expand(input_ids.shape[0], -1)
            prefix = (corpus, torch.ones_like(corpus, dtype=torch.bool))
        self.context = ContextBuffer(input_ids, real, prefix, max_new_tokens=None, max_gamma=0)

    def propose(self, gamma: int, choose: ChooseToken) -> tuple[torch.Tensor, torch.Tensor, None]:
        c = self.context
        c.reserve(gamma)
        batch = c.tokens.shape[0]
        tokens = torch.empty(batch, gamma, dtype=torch.int64, device=c.tokens.device)
        q_logits = torch.empty(batch, gamma, self.vocab, dtype=torch.float32, device=c.tokens.device)
        end = c.end
        for i in range(gamma):
            logits = ngram_distribution(c.tokens, c.start, end, self.order, self.vocab).clamp(min=Q_FLOOR).log()
            token = choose(logits, i)  # masks logits in place as the target's are, then draws from them
            q_logits[:, i], tokens[:, i] = logits, token
            # the draft joins the context past its end (``observe`` overwrites it with what is emitted)
            c.tokens.scatter_(1, end.unsqueeze(1), token.clamp(min=0).unsqueeze(1))
            end = end + 1
        return tokens, q_logits, None

    def observe(self, out: torch.Tensor, accepted: torch.Tensor | None, finished: torch.Tensor) -> None:
        self.context.append(out, emitted_counts(accepted, finished))

    def accept(self, draft_tokens, accepted, accepted_host, next_token, finished) -> None:
        """Nothing to roll back: the drafts past the context's end are overwritten by ``observe``."""

    def proposal_counts(self) -> None:
        return None

    def select_rows(self, index: torch.Tensor) -> None:
        self.context.select_rows(index)

    def add_rows(self, other: "NGramDrafter") -> None:
        """Append ``other``'s rows (an n-gram drafter of the same order, vocabulary and corpus, started on them)."""
        if not isinstance(other, NGramDrafter) or (other.vocab, other.order) != (self.vocab, self.order) \
                or (other.corpus is None) != (self.corpus is None) or other.context is None:
            raise ValueError("add_rows needs another started NGramDrafter of the same order, vocabulary and corpus")
        self.context.add_rows(other.context)

    def lengths_to_read(self) -> torch.Tensor:
        return self.context.end

    def lengths_read(self, lengths: list[int]) -> None:
        self.context.lengths_read(lengths)

    @property
    def forwards(self) -> int:
        return 0

    @property
    def compactions(self) -> int:
        return 0
