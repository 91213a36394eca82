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
* a tokenizer that cleans up tokenization spaces (its ``decode`` applies ``clean_up_tokenization``, which looks
  across token boundaries) is streamed from the full decode instead, held back from its last space, and every push
  checks that the text emitted so far is still a prefix of the full decode (``RuntimeError`` if not, never wrong
  text). That costs a decode of the whole sequence per push.

Each push costs two decodes of a few tokens otherwise. ``skip_prompt`` has no counterpart: push only the new tokens
(``DecodeSession.step`` returns only those).
"""

import re
from collections.abc import Iterable

import torch

REPLACEMENT = "\ufffd"
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
        self._emitted: list[str] = []  # everything returned, for the full-text paths' prefix check
        self._sent = 0  # characters returned
        self._cleans_up = _cleans_up(tokenizer, decode_kwargs)
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
        return self._cleaned(final=False) if self._cleans_up else self._window(final=False)

    def flush(self) -> str:
        """The text held back, at the end of the request. After it, the concatenation of everything returned is
        ``tokenizer.decode(token_ids, ...)``."""
        if self._flushed:
            return ""
        text = self._cleaned(final=True) if self._cleans_up else self._window(final=True)
        self._flushed = True
        return text

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

    def _cleaned(self, final: bool) -> str:
        if final:
            return self._from_full_text()
        text = self._full_text()
        end = text.rfind(" ", self._sent)  # clean-up patterns start with a space: hold back from the last one
        return self._emit(text[self._sent:end]) if end > self._sent else ""

    def _full_text(self) -> str:
        """The full decode, checked to extend what was emitted (RuntimeError otherwise: never wrong text)."""
        text = self._decode(self._ids)
        if not text.startswith("".join(self._emitted)):
            raise RuntimeError("this tokenizer's decode changed text that was already streamed")
        return text

    def _from_full_text(self) -> str:
        self._read = len(self._ids)
        return self._emit(self._full_text()[self._sent:])

    def _emit(self, new: str) -> str:
        self._emitted.append(new)
        self._sent += len(new)
        return new


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
    """Whether ``tokenizer.decode`` applies ``clean_up_tokenization``. Recent transformers skip it for BPE models
    unless forced (the tokenizer then has the forcing attribute); where that attribute is missing, a set flag is
    taken to mean clean-up, which streams exactly either way, only at the cost of a full decode per push."""
    flag = decode_kwargs.get("clean_up_tokenization_spaces")
    if flag is None:
        flag = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    if not flag:
        return False
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"  # transformers' own name
    backend = getattr(tokenizer, "backend_tokenizer", None)
    skips_bpe = hasattr(tokenizer, forced) and not getattr(tokenizer, forced)
    return not (skips_bpe and backend is not None and type(backend.model).__name__ == "BPE")


def _has_byte_fallback(tokenizer) -> bool:
    """Whether the tokenizer's decoder has a ByteFallback step (SentencePiece-style: Llama, Mistral, Gemma)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()
