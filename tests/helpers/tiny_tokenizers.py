"""Tiny tokenizers built locally with the ``tokenizers`` library (nothing is downloaded), wrapped as transformers'
``PreTrainedTokenizerFast``: a character tokenizer, a byte-level BPE trained on a few sentences, and any of them with
its ids permuted (the same tokens under other ids: a draft that is the target's own model under another vocabulary,
``permuted_model``)."""

import json

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SENTENCES = [
    "the cat sat on the mat and the dog sat on the log",
    "a quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target checks them",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "the draft proposes and the target disposes",
]
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' pad, bos and eos (helpers.models.SPECIAL)


def _wrap(tokenizer: Tokenizer, specials: bool = True) -> PreTrainedTokenizerFast:
    names = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>") if specials else {}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names)


def char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """One token per character of ``chars`` (ids in that order), no special tokens; decoding joins them."""
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    return _wrap(tokenizer, specials=False)


def byte_bpe(vocab_size: int, sentences=SENTENCES) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) trained on ``sentences``, with SPECIALS first: 259 ids
    are the bytes and specials (no merges), more are merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sentences, trainer)
    return _wrap(tokenizer)


def sentencepiece_like(vocab_size: int, sentences=SENTENCES) -> PreTrainedTokenizerFast:
    """A BPE built as Llama 2's fast tokenizer is: "▁" prepended and spaces written as "▁" by the normalizer, byte
    fallback, a decoder that strips the sequence's first space; SPECIALS then the 256 byte tokens first. The byte
    tokens are ordinary vocabulary, as in Llama 2's tokenizer.json (the trainer adds them as special tokens, which
    ``decode(skip_special_tokens=True)`` would drop: "é" decoded to "")."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=SPECIALS + [f"<0x{b:02X}>" for b in range(256)])
    tokenizer.train_from_iterator(sentences, trainer)
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [token for token in spec["added_tokens"] if token["content"] in SPECIALS]
    return _wrap(Tokenizer.from_str(json.dumps(spec)))


def permuted(tokenizer: PreTrainedTokenizerFast, perm: list[int], extra: tuple[str, ...] = ()):
    """The same tokenizer with token id i renamed perm[i] (special tokens keep their ids: perm must fix them), plus
    ``extra`` tokens after the others (tokens no text encodes to, so they only widen the vocabulary)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {token: perm[i] for token, i in vocab.items()}
    for token in spec["added_tokens"]:
        assert perm[token["id"]] == token["id"]
    for k, token in enumerate(extra):
        spec["model"]["vocab"][token] = len(perm) + k
    names = {f"{kind}_token": getattr(tokenizer, f"{kind}_token") for kind in ("bos", "eos", "pad")}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   **{k: v for k, v in names.items() if v is not None})


def permutation(size: int, fixed: int = 0, seed: int = 0) -> list[int]:
    """A random permutation of range(size) that keeps the first ``fixed`` ids."""
    rest = torch.randperm(size - fixed, generator=torch.Generator().manual_seed(seed)) + fixed
    return list(range(fixed)) + rest.tolist()


def permuted_model(model, perm: list[int], extra: int = 0):
    """A copy of a Llama-style ``model`` over the permuted vocabulary: new id perm[i] embeds and scores as id i did;
    ``extra`` more ids after them embed as id 0 and score one float below id 0 (perm[0]), so that a greedy argmax
    never picks them and they take about id 0's probability.

    (Not by copying id 0's head row: a one-token forward's output layer, a matrix-vector product, rounds identical
    weight rows to different logits (tail rows are accumulated in another order): with 19 ids, 2 of them extra, and
    random hidden states, an extra id came out above id 0 in a third of one-token forwards, in other rows with
    ATEN_CPU_CAPABILITY=default than with avx2 or avx512 and with two threads than with one, and would win the
    argmax wherever id 0 is the best. A forward hook on the output layer writes their logits
    [..., len(perm):] = nextafter(logit of perm[0], -inf).)"""
    import copy

    draft = copy.deepcopy(model)
    inverse = [0] * len(perm)
    for old, new in enumerate(perm):
        inverse[new] = old
    index = torch.tensor(inverse + [0] * extra)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight[index].clone()
        head = model.get_output_embeddings().weight[index].clone()
    draft.resize_token_embeddings(len(index), mean_resizing=False)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(embed)
        draft.get_output_embeddings().weight.copy_(head)
    if extra:
        from speculative_kernels import per_token_hook

        first = perm[0]

        def below_id_0(module, args, logits):  # logits [..., len(perm) + extra]
            with torch.no_grad():
                logits[..., len(perm):] = torch.nextafter(logits[..., first:first + 1],
                                                          logits.new_tensor(float("-inf")))

        draft.get_output_embeddings().register_forward_hook(per_token_hook(below_id_0))  # (every position alike)
    return draft.eval()
