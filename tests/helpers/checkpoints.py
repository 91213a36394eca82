"""Tiny model pairs saved to disk with a real tokenizer, as a user's checkpoints would be."""

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers.models import llama

CORPUS = [
    "def add(a, b): return a + b",
    "for i in range(10): print(i)",
    "class Point: x = 0; y = 0",
    "import os, sys; print(os.path.join('a', 'b'))",
    "while True: break",
] * 20


def tiny_tokenizer(vocab_size: int = 97) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  # (sorted: alphabet() is a set's order, which PYTHONHASHSEED changes, and with
                                  # it the vocabulary, the prompts' ids and a test's EOS: a flaky CLI test)
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())[:40])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def save_decoder_pair(root: Path) -> tuple[Path, Path]:
    """Target (2 layers) and draft (1 layer) Llama folders sharing one tokenizer. Returns their paths."""
    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer)
    paths = []
    for name, model in (("target", llama(layers=2, vocab=vocab, seed=0)), ("draft", llama(layers=1, vocab=vocab, seed=1))):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
