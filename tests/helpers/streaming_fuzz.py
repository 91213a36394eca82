"""Fuzz IncrementalDetokenizer against tokenizer.decode with locally built tokenizers (no downloads).

cd tests && python -m helpers.streaming_fuzz [--cases N] [--seed S] [--only NAME,...]
Prints, per tokenizer and skip_special_tokens: cases, failures (mismatch / exception) with the first examples, and
the hold-back: worst lag in tokens and characters behind an oracle that knows the final text, and the characters
an oracle could have emitted before the last push that came out only at flush.

2026-11-28 (transformers 5.24 and 5.17, tokenizers 0.23.3): before 68b8995 it found the clean-up tokenizers' stream
raising RuntimeError (12 streams of WordPiece); after it, seeds 1-5, 61,400 streams, 0 failures."""

import argparse
import collections
import json
import random


from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers.checkpoints import tiny_tokenizer  # byte-level BPE without a decoder: decode joins tokens with " "
from helpers.tiny_tokenizers import char_tokenizer, sentencepiece_like
from speculative_kernels.demo_pair import demo_model_paths
from speculative_kernels.streaming import IncrementalDetokenizer

TEXTS = [
    "naïve café — déjà vu, señor", "日本語のテキストと中文字符", "emoji 🚀🎉👍🏽 and ünïcödé", "Ελληνικά και русский",
    "def f(x):\n\treturn x ** 2  # квадрат", "mixed: a😀b€c𝄞d", "don't stop . ok , fine ! yes ?",
    "family 👩‍👩‍👧‍👦 and 👨🏿‍💻 at work", "combining e\u0301 a\u0300 o\u0308\u0304 n\u0303", "I do n't know , it ' s fine .",
    "they 're here and we 've gone , I 'm off", "spaces    runs\t\ttabs\n\nnewlines \n x", "한국어 텍스트 ไทย العربية",
    "can ' t won ' t isn ' t", "a . b ? c ! d , e ' f", "😀😀😀 ½ ¾ ∑∫√ ™ ©",
] * 6
CHARS = "abcdeno'tsm .,!?\n\t日本é\u0301\u200d👍🏽😀"


def _wrap(tok, **names):
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names)


def byte_level(add_prefix_space: bool, vocab_size=350):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())))
    return _wrap(tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def metaspace_special_bytes():
    """tests' metaspace_bpe: byte tokens are special tokens (skip_special_tokens drops them)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False))
    return _wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def unigram(clean_up: bool, byte_fallback: bool = True, decoder="metaspace"):
    """T5-like: Unigram with Metaspace pre-tokenizer and decoder; byte fallback."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False, byte_fallback=byte_fallback)
    tok.train_from_iterator(TEXTS, trainer)
    if byte_fallback:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                   prepend_scheme="always")])
    else:
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return _wrap(tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", clean_up_tokenization_spaces=clean_up)


def wordpiece(clean_up: bool):
    normalizer, pre = normalizers.NFC(), pre_tokenizers.BertPreTokenizer()
    words = collections.Counter(w for t in TEXTS for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(t)))
    chars = sorted({c for w in words for c in w})
    vocab = ["[UNK]", "[SEP]", "[CLS]"] + chars + ["##" + c for c in chars]
    vocab += sorted(w for w in words if len(w) <= 4 and w not in vocab)
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(dict.fromkeys(vocab))}, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre, decoders.WordPiece()
    return _wrap(tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]", clean_up_tokenization_spaces=clean_up)


def bpe_suffix():
    """OpenAI-GPT/CLIP style: BPE with an end-of-word suffix and BPEDecoder (suffix -> space, but not the last)."""
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                       end_of_word_suffix="</w>", show_progress=False))
    return _wrap(tok, unk_token="<unk>", eos_token="</s>")


def gemma_like():
    """Gemma-style: spaces as "▁" by the normalizer (no prepended one), byte fallback, and a decoder without Strip."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"]
                                  + [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(TEXTS, trainer)
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    return _wrap(Tokenizer.from_str(json.dumps(spec)), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                 unk_token="<unk>")


def metaspace_first(split=True):
    """Metaspace pre-tokenizer and decoder with prepend_scheme "first" (Llama-2 in tokenizers >= 0.19), BPE."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=split)
    tok.decoder = decoders.Metaspace(prepend_scheme="first", split=split)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=350, special_tokens=["<unk>", "<s>", "</s>"],
                                                       show_progress=False))
    return _wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _byt5(clean_up=False):
    from transformers import ByT5Tokenizer  # a python (slow) tokenizer: bytes, decoded with errors="ignore"

    return ByT5Tokenizer(clean_up_tokenization_spaces=clean_up)


def _canine():
    from transformers import CanineTokenizer  # python: one id per code point

    return CanineTokenizer()


def with_added(tokenizer):
    """Added tokens, special and not, with lstrip/rstrip/normalized/single_word variations."""
    tokenizer.add_tokens([AddedToken(" foo", lstrip=True), AddedToken("bar ", rstrip=True),
                          AddedToken("日本", normalized=False), AddedToken("qux", single_word=True),
                          AddedToken("<tool>", normalized=True), AddedToken("\u200d👍", normalized=False),
                          AddedToken("é", normalized=False)])
    tokenizer.add_special_tokens({"additional_special_tokens": [
        AddedToken("<|im_end|>", special=True, normalized=False), AddedToken(" <|sp|> ", lstrip=True, rstrip=True)]})
    if hasattr(tokenizer, "_tokenizer"):  # (tokenizers-backed only)
        tokenizer.backend_tokenizer.add_special_tokens([AddedToken("<|hidden|>", special=True)])  # named nowhere
    return tokenizer


def build():
    demo = PreTrainedTokenizerFast.from_pretrained(demo_model_paths()[0])
    made = {
        "byte_level": lambda: byte_level(False), "byte_level_prefix": lambda: byte_level(True),
        "demo": lambda: PreTrainedTokenizerFast.from_pretrained(demo_model_paths()[0]),
        "sp_llama2": lambda: sentencepiece_like(400, TEXTS), "sp_special_bytes": metaspace_special_bytes,
        "unigram_clean": lambda: unigram(True), "unigram_noclean": lambda: unigram(False),
        "unigram_nofallback_clean": lambda: unigram(True, byte_fallback=False),
        "wordpiece_clean": lambda: wordpiece(True), "wordpiece_noclean": lambda: wordpiece(False),
        "char": lambda: char_tokenizer(CHARS), "bpe_suffix": bpe_suffix,
        "no_decoder": tiny_tokenizer, "byt5_python": _byt5, "byt5_python_clean": lambda: _byt5(True),
        "canine_python": _canine, "gemma_like": gemma_like, "metaspace_first": metaspace_first,
        "metaspace_first_nosplit": lambda: metaspace_first(False),
    }
    for base in ("byte_level", "demo", "sp_llama2", "unigram_clean", "wordpiece_clean", "char", "byt5_python",
                 "gemma_like", "metaspace_first"):
        made[base + "+added"] = (lambda b=made[base]: with_added(b()))
    del demo
    return made


def chunks(rng, n, mode):
    if mode == "one":
        return [1] * n
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([0, 1, 1, 2, 3, 4, 5]))
    return sizes


def lcp(a, b):
    i = 0
    for x, y in zip(a, b):
        if x != y:
            break
        i += 1
    return i


def run_case(tokenizer, ids, sizes, skip, measure):
    final = tokenizer.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces, at, emitted_at = [], 0, []  # emitted_at[k]: chars emitted after k ids
    oracle = []
    for size in sizes:
        pieces.append(detok.push(ids[at:at + size]))
        at += size
        if measure:
            emitted_at.append((at, sum(map(len, pieces))))
            oracle.append((at, lcp(final, tokenizer.decode(ids[:at], skip_special_tokens=skip))))
    pieces.append(detok.flush())
    got = "".join(pieces)
    lag = None
    if measure and final:
        # token lag: for each char, first step the oracle had it vs first step we emitted it (flush: step len+1)
        def first_step(table, c, end):
            for step, (count, have) in enumerate(table):
                if have > c:
                    return step
            return end
        n = len(table := emitted_at)
        worst_tokens = max(first_step(emitted_at, c, n) - first_step(oracle, c, n) for c in range(len(final)))
        worst_chars = max(o[1] - e[1] for o, e in zip(oracle, emitted_at)) if oracle else 0
        at_flush = max(0, (oracle[-1][1] if oracle else 0) - (emitted_at[-1][1] if emitted_at else 0))
        lag = (worst_tokens, worst_chars, at_flush)
    return got, final, lag


def sequences(rng, tokenizer, cases):
    n = len(tokenizer)
    vocab = tokenizer.convert_ids_to_tokens(list(range(n)))
    specials = sorted(set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder))
    bytey = [i for i, t in enumerate(vocab) if t and (t.startswith("<0x") or (len(t) == 1 and ord(t) >= 0x80))]
    for k in range(cases):
        kind = k % 3
        if kind == 0:  # uniform random ids, a few past the vocabulary
            ids = [rng.randrange(n + (3 if rng.random() < 0.1 else 0)) for _ in range(rng.randint(0, 40))]
        elif kind == 1:  # byte-heavy and special-heavy
            pool = [bytey, specials, range(n)]
            ids = [rng.choice(rng.choices(pool, weights=[5, 2, 3])[0] or range(n)) for _ in range(rng.randint(0, 40))]
        else:  # real text with added/special ids inserted
            text = "".join(rng.choice(TEXTS)[rng.randrange(5):] + rng.choice(["", " ", "\n", "  ", "\t"])
                           for _ in range(rng.randint(1, 3)))
            ids = tokenizer.encode(text, add_special_tokens=False)
            for _ in range(rng.randint(0, 3)):
                if specials:
                    ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        yield kind, ids


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    made = build()
    names = args.only.split(",") if args.only else list(made)
    total = 0
    for name in names:
        tokenizer = made[name]()
        for skip in (False, True):
            rng = random.Random(f"{args.seed}-{name}-{skip}")
            fails, errors, lags, count = [], collections.Counter(), [0, 0, 0], 0
            for kind, ids in sequences(rng, tokenizer, args.cases):
                for mode in ("one", "random"):
                    sizes = chunks(rng, len(ids), mode)
                    try:
                        tokenizer.decode(ids, skip_special_tokens=skip)
                    except Exception as exc:  # noqa: BLE001  (decode itself fails: nothing to stream)
                        errors[f"decode itself raises {type(exc).__name__} (not counted)"] += 1
                        continue
                    count += 1
                    try:
                        got, final, lag = run_case(tokenizer, ids, sizes, skip, measure=(mode == "one" and kind == 2))
                    except Exception as exc:  # noqa: BLE001
                        errors[f"{type(exc).__name__}: {exc}"] += 1
                        if len(fails) < 3:
                            fails.append(("raise", ids, sizes, repr(exc)))
                        continue
                    if got != final:
                        errors["mismatch"] += 1
                        if len(fails) < 3:
                            fails.append(("mismatch", ids, sizes, (got, final)))
                    if lag:
                        lags = [max(a, b) for a, b in zip(lags, lag)]
            total += count
            failures = sum(n for what, n in errors.items() if "not counted" not in what)
            print(f"{name:28s} skip={skip!s:5s} streams={count:4d} failures={failures:3d} "
                  f"worst lag: {lags[0]} tokens, {lags[1]} chars; oracle-known chars held to flush: {lags[2]}",
                  flush=True)
            for what, n in errors.items():
                print(f"    {n} x {what}")
            for fail in fails:
                print("    example:", json.dumps(fail, ensure_ascii=False)[:600])
    print("total streams", total)


if __name__ == "__main__":
    main()
