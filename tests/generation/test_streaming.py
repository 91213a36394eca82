"""``IncrementalDetokenizer``: every push plus the flush, concatenated, is exactly ``tokenizer.decode`` of all the
ids, for byte-level BPE with multi-byte UTF-8 characters split across tokens, SentencePiece-style Metaspace
decoding, and a tokenizer that cleans up spaces; on real text nothing is streamed before it is final (no U+FFFD
from a half character)."""

import collections
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import speculative_kernels as sk
from helpers.checkpoints import tiny_tokenizer
from helpers.models import llama
from speculative_kernels.demo_pair import demo_model_paths
from speculative_kernels.streaming import IncrementalDetokenizer

TEXTS = [
    "naïve café — déjà vu, señor", "日本語のテキストと中文字符", "emoji 🚀🎉👍🏽 and ünïcödé",
    "Ελληνικά και русский",
    "def f(x): return x ** 2  # квадрат", "mixed: a😀b€c𝄞d", "don't stop . ok , fine ! yes ?",
] * 10


def byte_level_bpe(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """Byte-level BPE over all 256 bytes with few merges: most non-ASCII characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()))  # (a set: sorted)
    tok.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def metaspace_bpe() -> PreTrainedTokenizerFast:
    """SentencePiece-style: spaces become '▁', and the decoder drops the leading space of a string."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def wordpiece_with_cleanup(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """BERT-style: WordPiece with '##' continuations, and clean_up_tokenization_spaces (" ." -> ".").

    The vocabulary is built here, in a fixed order (characters, their '##' forms, then short words and '##'
    two-character pieces by frequency, longer words left split into pieces): WordPieceTrainer numbers its '##'
    tokens in a hash map's per-process order (huggingface/tokenizers#1794), so a trained vocabulary, and the
    streams these tests feed, changed with every run."""
    normalizer, pre = normalizers.NFC(), pre_tokenizers.BertPreTokenizer()
    words = collections.Counter(word for text in TEXTS
                                for word, _ in pre.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in words for c in word})
    vocab = ["[UNK]", "[SEP]"] + chars + ["##" + c for c in chars]
    pieces = collections.Counter()
    for word, count in words.items():
        for i in range(1, len(word)):
            pieces["##" + word[i:i + 2]] += count
    short = {word: count for word, count in words.items() if len(word) <= 4}
    by_frequency = sorted(short.items(), key=lambda kv: (-kv[1], kv[0])) + \
        sorted(pieces.items(), key=lambda kv: (-kv[1], kv[0]))
    for token, _ in by_frequency:
        if len(vocab) >= vocab_size:
            break
        if token not in vocab:
            vocab.append(token)
    tok = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre, decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


def test_the_wordpiece_tokenizer_is_the_same_in_every_process():
    """Its vocabulary is a function of TEXTS alone (the trained one was not: compared with a process of another hash
    seed than this one's), and it splits words into '##' pieces, which is what the streaming tests need of it."""
    import hashlib
    import os
    import subprocess
    import sys

    tok = wordpiece_with_cleanup()
    ids = [i for text in TEXTS for i in tok.encode(text, add_special_tokens=False)]
    assert any(t.startswith("##") for t in tok.convert_ids_to_tokens(ids))
    assert tok.decode(tok.encode("stop . ok", add_special_tokens=False)) == "stop. ok"
    here = hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()
    script = ("import hashlib; from generation.test_streaming import wordpiece_with_cleanup as w; "
              "print(hashlib.sha256(w().backend_tokenizer.to_str().encode()).hexdigest())")
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # one other process (each imports torch and transformers: ~5 s), with a hash seed this one's is not: this one's
    # is random (unset) or the one it was given
    seed = "4" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=tests_dir + os.pathsep + os.environ.get("PYTHONPATH", ""))
    other = subprocess.run([sys.executable, "-c", script], env=env, cwd=tests_dir, capture_output=True, text=True,
                           check=True).stdout.split()[-1]
    assert other == here, seed


@pytest.fixture(scope="module")
def tokenizers_():
    demo = PreTrainedTokenizerFast.from_pretrained(demo_model_paths()[0])
    flagged = byte_level_bpe()  # the flag set on a BPE model, which recent transformers ignore (GPT-2's configs)
    flagged.clean_up_tokenization_spaces = True
    forced = byte_level_bpe()  # and forced (LUKE's tokenizers): its decode cleans up, and so must the stream
    forced.clean_up_tokenization_spaces = True
    forced.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    return {"byte_level": byte_level_bpe(), "demo": demo, "metaspace": metaspace_bpe(),
            "wordpiece_cleanup": wordpiece_with_cleanup(), "byte_level_cleanup_flag": flagged,
            "byte_level_cleanup_forced": forced}


def stream(tokenizer, ids, chunks, **kwargs):
    """(the pieces each push and the flush returned, their concatenation), pushing ids in ``chunks`` sizes."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces, at = [], 0
    for size in chunks:
        pieces.append(detok.push(ids[at:at + size]))
        at += size
    pieces.append(detok.flush())
    return pieces, "".join(pieces)


def chunk_sizes(rng, length):
    sizes = []
    while sum(sizes) < length:
        sizes.append(rng.randint(1, 4))  # a speculative iteration emits 1..gamma+1 tokens
    return sizes


@pytest.mark.parametrize("name", ["byte_level", "demo", "metaspace", "wordpiece_cleanup", "byte_level_cleanup_flag"])
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_random_token_sequences_stream_to_the_full_decode(tokenizers_, name, skip_special_tokens):
    tokenizer = tokenizers_[name]
    rng = random.Random(len(name) + skip_special_tokens)
    for _ in range(150):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 40))]
        _, text = stream(tokenizer, ids, chunk_sizes(rng, len(ids)), skip_special_tokens=skip_special_tokens)
        assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


@pytest.mark.parametrize("name", ["byte_level", "demo", "metaspace", "wordpiece_cleanup", "byte_level_cleanup_forced"])
def test_real_text_streams_only_final_text(tokenizers_, name):
    """Encoded text pushed one token at a time: the pieces join to the decode, no piece holds a U+FFFD from a split
    character, and every piece is final (the text so far is a prefix of the decode)."""
    tokenizer = tokenizers_[name]
    split_characters = 0
    for text in TEXTS[:7]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids)
        pieces, joined = stream(tokenizer, ids, [1] * len(ids))
        assert joined == full
        assert not any("\ufffd" in piece for piece in pieces), pieces
        for i in range(1, len(ids) + 1):
            split_characters += "\ufffd" in tokenizer.decode(ids[:i])
    if name in ("byte_level", "demo"):
        assert split_characters > 5  # the test does meet characters split across tokens


def t5_like_with_cleanup() -> PreTrainedTokenizerFast:
    """A Unigram over a few pieces with Metaspace decoding (T5-style) and clean_up_tokenization_spaces (set by a
    checkpoint's tokenizer_config; transformers applies the clean-up to every model type but BPE)."""
    pieces = ["<unk>", "▁", "▁i", "▁do", "▁n", "▁'", "'", "▁t", "t", "▁s", "▁a", "日", "本", "語", "▁."]
    tok = Tokenizer(models.Unigram([(piece, -1.0) for piece in pieces], unk_id=0))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", clean_up_tokenization_spaces=True)


def test_clean_up_that_joins_across_two_spaces_streams_exactly_and_spaceless_text_is_not_held():
    """clean_up_tokenization's replacements chain: " ' " -> "'" then " n't" -> "n't" or " 's" -> "'s", so
    "i do n ' t" cleans to "i don't" and "a  ' s" to "a's": a space before the last one is removed. The stream held
    back only from the last space, emitted " n" (or "a "), and raised RuntimeError at the next token (BERT
    tokenizes "do n't" so; the server's stream ended without [DONE]). And text without spaces (Chinese, Japanese)
    was held back entirely until flush: it comes out as it is decoded now."""
    tokenizer = t5_like_with_cleanup()
    for tokens in (["▁i", "▁do", "▁n", "▁'", "▁t", "▁."], ["▁a", "▁", "▁'", "▁s"], ["▁do", "▁n", "▁", "'", "▁t"],
                   ["▁do", "▁n", "'", "t"]):  # (the last: " n't" spans 3 characters past its space)
        ids = tokenizer.convert_tokens_to_ids(tokens)
        detokenizer = IncrementalDetokenizer(tokenizer)
        pieces = [detokenizer.push([token]) for token in ids]
        assert "".join(pieces) + detokenizer.flush() == tokenizer.decode(ids), tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([token]) for token in tokenizer.convert_tokens_to_ids(["日", "本", "語"])] == \
        ["日", "本", "語"]


    class OwnCleanUp(PreTrainedTokenizerFast):  # (as CLVP's tokenizer): its text is cleaned up at flush only
        def clean_up_tokenization(self, text):
            return text.replace("日本", "にほん")

    own = OwnCleanUp(tokenizer_object=tokenizer.backend_tokenizer, unk_token="<unk>",
                     clean_up_tokenization_spaces=True)
    ids = own.convert_tokens_to_ids(["▁a", "日", "本", "語"])
    detokenizer = IncrementalDetokenizer(own)
    assert [detokenizer.push([token]) for token in ids] + [detokenizer.flush()] == ["", "", "", "", "aにほん語"]
    assert own.decode(ids) == "aにほん語"


def test_clean_up_is_final_where_clean_up_split_says():
    """Every split of every string over " 'nt" up to 6 characters that clean_up_split calls final cleans up as its
    two halves, with this transformers' clean_up_tokenization (a replacement that reached further, or 2 as the
    reach, fails: " n'" + "t" -> "n't")."""
    import itertools

    from speculative_kernels.streaming import clean_up_split
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    def clean(text):
        return PreTrainedTokenizerBase.clean_up_tokenization(None, text)

    checked = 0
    for length in range(2, 7):
        for chars in itertools.product(" 'nt", repeat=length):
            text = "".join(chars)
            for end in range(1, length):
                if clean_up_split(text[:end], 0) == end:
                    checked += 1
                    assert clean(text[:end]) + clean(text[end:]) == clean(text), (text[:end], text[end:])
    assert checked > 10000


def test_text_is_held_back_until_a_character_is_complete(tokenizers_):
    tokenizer = tokenizers_["byte_level"]
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🚀"]
    assert detok.flush() == ""
    truncated = IncrementalDetokenizer(tokenizer)  # a request that ends mid-character ends as decode() does
    assert truncated.push(ids[:-1]) == "" and truncated.flush() == tokenizer.decode(ids[:-1])


def test_skip_special_tokens_and_tensors(tokenizers_):
    tokenizer = tokenizers_["byte_level"]
    ids = tokenizer.encode("café", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    text = detok.push(torch.tensor([ids[:2]])) + detok.push(torch.tensor(ids[2:])) + detok.flush()
    assert text == "café" and detok.token_ids == ids
    kept = IncrementalDetokenizer(tokenizer)
    assert kept.push(ids) + kept.flush() == "café</s>"


def test_bad_inputs_are_refused(tokenizers_):
    detok = IncrementalDetokenizer(tokenizers_["byte_level"])
    with pytest.raises(ValueError, match="one request"):
        detok.push(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer tensor"):
        detok.push(torch.zeros(3))
    for bad in ("abc", 3, [1, True], [1, -2], [1.0]):
        with pytest.raises(TypeError, match="token_ids"):
            detok.push(bad)
    with pytest.raises(TypeError, match="tokenizer"):
        IncrementalDetokenizer(object())
    detok.flush()
    with pytest.raises(RuntimeError, match="flushed"):
        detok.push([1])


def test_one_detokenizer_per_row_of_a_session():
    """The serving pattern: one detokenizer per request, fed by DecodeSession.step."""
    tokenizer = tiny_tokenizer()
    target, draft = llama(vocab=len(tokenizer)), llama(layers=1, vocab=len(tokenizer), seed=2)
    ids = torch.randint(4, len(tokenizer), (3, 5), generator=torch.Generator().manual_seed(0))
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        ids, max_new_tokens=16, do_sample=True, temperature=1.0, pad_token_id=0, seed=4)
    detoks = [IncrementalDetokenizer(tokenizer, skip_special_tokens=True) for _ in range(3)]
    texts = [""] * 3
    while not session.finished:
        for row, tokens in enumerate(session.step()):
            texts[row] += detoks[row].push(tokens)
    sequences = session.sequences()
    for row in range(3):
        texts[row] += detoks[row].flush()
        assert texts[row] == tokenizer.decode(detoks[row].token_ids, skip_special_tokens=True)
        assert detoks[row].token_ids == sequences[row, 5:5 + len(detoks[row].token_ids)].tolist()


def test_hf_streamers_need_batch_one_and_say_what_to_use_instead():
    from transformers import TextStreamer

    tokenizer = tiny_tokenizer()
    target = llama(vocab=len(tokenizer))
    ids = torch.randint(4, len(tokenizer), (2, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="batch size 1 only.*IncrementalDetokenizer"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=4, streamer=TextStreamer(tokenizer))
    with pytest.raises(ValueError, match="not available on a session.*IncrementalDetokenizer"):
        sk.SpeculativeDecoder(target, target).start(ids, max_new_tokens=4, streamer=TextStreamer(tokenizer))


def test_a_skipped_special_token_inside_a_byte_run_holds_the_run_back():
    """SentencePiece-style byte fallback (Llama, Mistral, Gemma), skip_special_tokens=True: the decode drops a
    special id before its decoder joins byte tokens, so [<0x5A>, <unk>, <0x97>] decodes as one run (invalid
    UTF-8). The stream took the special id as the end of the run and emitted 'Z', then failed at flush with a
    RuntimeError (the server's stream ended without [DONE])."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=[]))
    tok.add_tokens([f"<0x{b:02X}>" for b in range(256)])  # byte tokens, not special
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    byte = tokenizer.convert_tokens_to_ids
    for ids in ([byte("<0x5A>"), tokenizer.unk_token_id, byte("<0x97>")],
                [byte("<0xC3>"), tokenizer.eos_token_id, byte("<0xA9>"), byte("<0x5A>")]):
        full = tokenizer.decode(ids, skip_special_tokens=True)
        detokenizer = sk.IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        pieces = [detokenizer.push([token]) for token in ids]
        assert "".join(pieces) + detokenizer.flush() == full


def test_ids_the_decode_drops_inside_a_byte_run_hold_the_run_back():
    """As above, for the ids the decode drops that are not in all_special_ids: an id past the tokenizer (a model
    whose embedding is padded past it, as Phi-3's 32064 rows over a 32000-token tokenizer, can sample one) and, with
    skip_special_tokens, a token marked special in tokenizer.json but named in no tokenizer setting (as Qwen's
    <|im_end|>-style tokens). The byte tokens are in the model's vocabulary, as in Llama 2's tokenizer.json. The
    stream emitted text the full decode does not have, then raised RuntimeError at flush."""
    import json

    from tokenizers import AddedToken

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(["hello world, naïve café"] * 10,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(state))
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    byte, end, past = tokenizer.convert_tokens_to_ids, tok.token_to_id("<|im_end|>"), len(tokenizer) + 5
    assert end not in tokenizer.all_special_ids
    for dropped, skip in ((end, True), (past, True), (past, False)):
        for ids in ([byte("<0x5A>"), dropped, byte("<0x97>")],
                    [byte("<0xC3>"), dropped, byte("<0xA9>"), byte("<0x5A>")]):
            full = tokenizer.decode(ids, skip_special_tokens=skip)
            detokenizer = sk.IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            pieces = [detokenizer.push([token]) for token in ids]
            assert "".join(pieces) + detokenizer.flush() == full, (ids, skip)


def test_a_streamer_that_edits_what_it_is_given_changes_nothing():
    """On the CPU, put() was handed a view of our output buffer (``.cpu()`` copies nothing there): a streamer that
    edits its argument in place (reuses it as a buffer) zeroed our returned tokens, and with repetition_penalty
    changed the tokens generated. model.generate puts tensors it does not read again; so do we now."""
    from helpers.models import perturbed

    class Scribbler:
        def __init__(self):
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:  # (HF's prompt put aliases input_ids on the CPU too)
                value.fill_(0)

        def end(self):
            pass

    target = llama()
    draft = perturbed(target)
    ids = torch.tensor([[5, 17, 33, 8, 61]])
    for kwargs in (dict(), dict(repetition_penalty=1.5)):
        expected = target.generate(ids, max_new_tokens=12, do_sample=False, **kwargs)
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=12,
                          do_sample=False, streamer=Scribbler(), **kwargs)
        assert torch.equal(got, expected), kwargs
