"""Checking that draft and target speak one vocabulary, and bridging a padded draft vocabulary exactly.

Exactness only needs q to be the distribution the draft token was drawn from, over the target's ids. So:

* same width V: nothing to do;
* draft wider (V_d > V): the draft's logits are cut to the target's V before sampling and verification;
* draft narrower (V_d < V): the draft's logits are padded with -inf (q = 0 there, never proposed), and a target
  token the draft cannot embed (id >= V_d) is fed to the draft as id 0: what the draft conditions on never changes
  the output distribution, only the acceptance rate.

Different widths are only accepted when both tokenizers are given and map every token to the same id; otherwise
different ``vocab_size``s are an error. Tokenizers that disagree are another path: the draft re-tokenizes the text
(``retokenizing_drafter.py``; ``tokenizers_differ``), and ``VocabBridge`` refuses them.
"""

import torch


def logit_width(model) -> int:
    embeddings = model.get_output_embeddings()
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return int(embeddings.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def check_tokenizers(tokenizer, assistant_tokenizer) -> None:
    """Raise ValueError unless the two tokenizers assign the same ids to the same tokens."""
    if tokenizer is None or assistant_tokenizer is None:
        return
    target_vocab, draft_vocab = tokenizer.get_vocab(), assistant_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        raise ValueError(
            "draft and target tokenizers have different vocabularies "
            f"({len(target_vocab)} vs {len(draft_vocab)} tokens, {only_target} target entries differ); "
            "speculative decoding needs one shared vocabulary"
        )


def tokenizers_differ(tokenizer, assistant_tokenizer) -> bool:
    """Whether both tokenizers are given and assign ids differently (a draft with another tokenizer: its text is
    re-tokenized, ``retokenizing_drafter.py``; tokenizers that agree keep one vocabulary, ``VocabBridge``)."""
    if tokenizer is None or assistant_tokenizer is None or tokenizer is assistant_tokenizer:
        return False
    return tokenizer.get_vocab() != assistant_tokenizer.get_vocab()


def vocabulary_size(model) -> int:
    """The number of ids the input embedding of ``model`` takes (its text config's vocab_size without one); a
    plain module without get_input_embeddings (FSMT's encoder and decoder stacks): its ``embed_tokens``."""
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else getattr(model, "embed_tokens", None)
    size = getattr(embeddings, "num_embeddings", None)
    return int(size) if size is not None else int(model.config.get_text_config().vocab_size)


def check_ids_in_vocabulary(model, name: str, ids: torch.Tensor) -> None:
    """ValueError naming ``name`` unless every id is in [0, vocabulary size) of ``model``'s input embedding (HF
    fails on such ids with an IndexError inside the embedding). One host read, before decoding starts."""
    if ids.numel() == 0:
        return
    vocab = vocabulary_size(model)
    low, high = torch.aminmax(ids)
    if int(low) < 0 or int(high) >= vocab:
        bad = int(low) if int(low) < 0 else int(high)
        raise ValueError(f"{name} holds id {bad}, outside the vocabulary [0, {vocab}) of the model's embedding")


def embeddable_ids(ids: torch.Tensor, size: int) -> torch.Tensor:
    """ids [...] as a draft whose input embedding has ``size`` rows is fed them: those >= size become 0 (see the
    module docstring: only what the draft conditions on, so acceptance, can change)."""
    return torch.where(ids < size, ids, torch.zeros_like(ids))


class VocabBridge:
    """Maps draft logits onto the target vocabulary and target tokens onto draft inputs."""

    def __init__(self, target, draft, tokenizer=None, assistant_tokenizer=None):
        check_tokenizers(tokenizer, assistant_tokenizer)
        self.target_width = logit_width(target)
        self.draft_width = logit_width(draft)
        target_size = target.config.get_text_config().vocab_size
        draft_size = draft.config.get_text_config().vocab_size
        if (target_size != draft_size or self.target_width != self.draft_width) and (
            tokenizer is None or assistant_tokenizer is None
        ):
            raise ValueError(
                f"draft and target have different vocabularies: the draft's logits are {self.draft_width} wide "
                f"(config vocab_size {draft_size}), the target's {self.target_width} (config vocab_size "
                f"{target_size}); if they share a tokenizer and differ only by padding, pass tokenizer= and "
                "assistant_tokenizer= so the ids can be checked (with tokenizers of different vocabularies the "
                "draft then drafts on its own tokenization of the text: universal assisted generation)"
            )

    @property
    def identity(self) -> bool:
        return self.draft_width == self.target_width

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_d] -> [..., V] (cut, or padded with -inf)."""
        if self.draft_width > self.target_width:
            return logits[..., : self.target_width]
        if self.draft_width < self.target_width:
            pad = logits.new_full((*logits.shape[:-1], self.target_width - self.draft_width), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def draft_inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids -> ids the draft can embed (ids >= V_d become 0; see the module docstring)."""
        if self.draft_width < self.target_width:
            return embeddable_ids(tokens, self.draft_width)
        return tokens
