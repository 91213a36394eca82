"""Text streaming per request: ``IncrementalDetokenizer`` turns the token ids a request emits, a few at a time (what
``DecodeSession.step`` returns for its row), into new text as soon as that text is final.

What HF's ``TextStreamer`` does for one sequence, with one difference: the concatenation of every ``push`` and the
``flush`` is exactly ``tokenizer.decode(all_ids, skip_special_tokens=...)``. ``TextStreamer`` restarts its decoding
after every newline and prints up to the last space, so a tokenizer that decodes a token differently at the start
of a string (SentencePiece's leading space) or cleans up spaces (``" ."`` -> ``"."``) can stream text that differs
from the full decode. Here:

* a push decodes a window of the ids: the tokens of the previous emission as context, then the new ones, and emits
  what the new ones add to the context's text (the prefix/read offsets of TGI's and vLLM's detokenizers). The
  context keeps the first token of the window, whose decoding may differ at the start of a string, already emitted;
* text ending in U+FFFD is held back: a multi-byte UTF-8 character split across tokens decodes to U+FFFD until its
  last byte arrives (byte-level BPE). So is the text of a run of byte tokens ``<0xNN>`` of a ByteFallback decoder
  (SentencePiece-style), which decodes the run as a whole. ``flush`` emits whatever is held back, so an invalid
  byte sequence comes out as the full decode has it;
* a tokenizer that cleans up tokenization spaces (its ``decode`` applies ``clean_up_tokenization``, whose
  replacements look across token boundaries: ``" ."`` -> ``"."``, and chained, ``"do n ' t"`` -> ``"don't"``)
  streams its text without the clean-up as above, and cleans it up to the last point with no space in the 3
  characters before it: every replacement begins with a space and reaches at most 3 characters past one, so no
  later text can change the clean-up before that point. A trailing space and the 3 characters after a space are
  held back; text without spaces (Chinese, Japanese) is not. (A tokenizer class that overrides
  ``clean_up_tokenization`` is cleaned at flush only: all its text is held back.)

Each push costs two decodes of a few tokens. ``skip_prompt`` has no counterpart: push only the new tokens
(``DecodeSession.step`` returns only those).
"""

import re
from collections.abc import Iterable

import torch

REPLACEMENT = "\ufffd"
CLEAN_UP_REACH = 3  # transformers' clean_up_tokenization changes no text more than 3 characters past a space
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    """One request's text, pushed token ids at a time.

    tokenizer: a transformers tokenizer (``decode``); skip_special_tokens, decode_kwargs: passed to every
    ``tokenizer.decode`` call, so the stream matches ``tokenizer.decode(ids, skip_special_tokens, **decode_kwargs)``.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = False, **decode_kwargs):
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must be a transformers tokenizer (with decode()), got "
                            f"{type(tokenizer).__name__}")
        self._tokenizer = tokenizer
        self._decode_kwargs = dict(decode_kwargs, skip_special_tokens=bool(skip_special_tokens))
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids[prefix:read] are context, their text already emitted
        self._read = 0  # ids[read:] have not been emitted yet
        self._text = ""  # the window's text so far (before the clean-up, where the tokenizer cleans up)
        self._cleans_up = _cleans_up(tokenizer, decode_kwargs)
        if self._cleans_up:  # the window decodes without the clean-up; _clean_up applies it where it is final
            self._decode_kwargs["clean_up_tokenization_spaces"] = False
        self._clean_up_is_local = self._cleans_up and _default_clean_up(tokenizer)  # (clean_up_split holds for it)
        self._cleaned = 0  # text[:cleaned] was cleaned up and returned (clean-up path)
        self._byte_fallback = _has_byte_fallback(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ())) | frozenset(
            i for i, t in added.items() if getattr(t, "special", False))  # what skip_special_tokens drops
        self._flushed = False

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far (a copy)."""
        return list(self._ids)

    def push(self, token_ids) -> str:
        """Add token_ids (a sequence of ints, or a [n] / [1, n] integer tensor); returns the new final text ("" when
        it is held back: an incomplete UTF-8 character, or a word that clean-up could still change)."""
        if self._flushed:
            raise RuntimeError("the detokenizer was flushed; start a new one for a new request")
        self._ids.extend(_ids(token_ids))
        text = self._window(final=False)
        return self._clean_up(final=False) if self._cleans_up else text

    def flush(self) -> str:
        """The text held back, at the end of the request. After it, the concatenation of everything returned is
        ``tokenizer.decode(token_ids, ...)``."""
        if self._flushed:
            return ""
        text = self._window(final=True)
        self._flushed = True
        return self._clean_up(final=True) if self._cleans_up else text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._decode_kwargs)

    def _window(self, final: bool) -> str:
        if self._read == len(self._ids) or (not final and self._ends_in_byte_token()):
            return ""
        context = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if not text.startswith(context):  # the new tokens changed the context's text: wait, or end on the full text
            return self._from_full_text() if final else ""
        new = text[len(context):]
        if not new or (not final and new.endswith(REPLACEMENT)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return self._emit(new)

    def _ends_in_byte_token(self) -> bool:
        """Whether the last id is a byte token ``<0xNN>`` of a ByteFallback decoder, which decodes a run of them
        together (invalid UTF-8: one U+FFFD per token of the run), so the next token may change the run's text.
        With skip_special_tokens, the last id that is kept: the decode drops special ids before the decoder
        sees the ids, so a byte run goes on across them."""
        if not self._byte_fallback:
            return False
        last = next((token for token in reversed(self._ids) if not self._dropped(token)), None)
        if last is None:
            return False
        return _BYTE_TOKEN.fullmatch(self._tokenizer.convert_ids_to_tokens(last) or "") is not None

    def _dropped(self, token: int) -> bool:
        """Whether the decode drops this id before its decoder joins byte tokens: an id outside the vocabulary
        (a model's padded embedding rows), or, with skip_special_tokens, a special one (named, or marked special
        in tokenizer.json's added tokens)."""
        if self._tokenizer.convert_ids_to_tokens(token) is None:
            return True
        return self._decode_kwargs["skip_special_tokens"] and token in self._special_ids

    def _clean_up(self, final: bool) -> str:
        """The cleaned-up text that is final now: the window's text up to its end (final=True) or to the last point
        no later text can change (clean_up_split), cleaned up from the previous such point."""
        if final:
            end = len(self._text)
        elif self._clean_up_is_local:
            end = clean_up_split(self._text, self._cleaned)
        else:
            return ""
        if end == self._cleaned:
            return ""
        text = self._tokenizer.clean_up_tokenization(self._text[self._cleaned:end])
        self._cleaned = end
        return text

    def _full_text(self) -> str:
        """The full decode, checked to extend what was emitted (RuntimeError otherwise: never wrong text)."""
        text = self._decode(self._ids)
        if not text.startswith(self._text):
            raise RuntimeError("this tokenizer's decode changed text that was already streamed")
        return text

    def _from_full_text(self) -> str:
        self._read = len(self._ids)
        return self._emit(self._full_text()[len(self._text):])

    def _emit(self, new: str) -> str:
        self._text += new
        return new


def clean_up_split(raw: str, start: int) -> int:
    """The last index end >= start of raw (or start) with no space in raw[end - CLEAN_UP_REACH:end].

    Every replacement of transformers' clean_up_tokenization begins with a space, and none, chained ones included
    ("do n ' t" -> "do n't" -> "don't": a space at least every 2 characters), spans more than 3 characters past
    a space; so none spans such an end, and clean_up(raw[:end] + more) == clean_up(raw[:end]) + clean_up(more)
    for any later text. start must be such an index (0 is)."""
    end = len(raw)
    while end > start:
        space = raw.rfind(" ", max(0, end - CLEAN_UP_REACH), end)
        if space < 0:
            return end
        end = space
    return start


def _ids(token_ids) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be a [n] or [1, n] tensor (one request), got shape "
                             f"{tuple(token_ids.shape)}")
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
        token_ids = token_ids.tolist()
    elif not isinstance(token_ids, Iterable) or isinstance(token_ids, (str, bytes)):
        raise TypeError(f"token_ids must be a sequence of ints or a tensor, got {type(token_ids).__name__}")
    ids = list(token_ids)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise TypeError(f"token_ids must hold non-negative ints, got {token!r}")
    return ids


def _cleans_up(tokenizer, decode_kwargs: dict) -> bool:
    """Whether ``tokenizer.decode`` applies ``clean_up_tokenization``: the flag is set, and the tokenizer is not one
    whose decode skips it, a tokenizers-backed BPE model not forced to clean up (transformers 5's rule, with its
    forcing attribute; slow and mistral-common tokenizers, which have no backend_tokenizer, clean up whenever the
    flag is set, as transformers without that attribute did). The stream applies the clean-up itself, so this must
    be what decode does (test_streaming streams a BPE with the flag, forced and not, WordPiece and Unigram ones)."""
    flag = decode_kwargs.get("clean_up_tokenization_spaces")
    if flag is None:
        flag = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    if not flag:
        return False
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"  # transformers' own name
    backend = getattr(tokenizer, "backend_tokenizer", None)
    skips_bpe = hasattr(tokenizer, forced) and not getattr(tokenizer, forced)
    return not (skips_bpe and backend is not None and type(backend.model).__name__ == "BPE")


def _default_clean_up(tokenizer) -> bool:
    """Whether the tokenizer's clean_up_tokenization is transformers' own (CLVP's, for one, is not), whose
    replacements clean_up_split is written for."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    return getattr(type(tokenizer), "clean_up_tokenization", None) is PreTrainedTokenizerBase.clean_up_tokenization


def _has_byte_fallback(tokenizer) -> bool:
    """Whether the tokenizer's decoder has a ByteFallback step (SentencePiece-style: Llama, Mistral, Gemma)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()
