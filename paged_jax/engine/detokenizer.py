"""Incremental detokenization with stop strings (one ``IncrementalDetokenizer`` per output sequence).

Decoding technique (vLLM / HF ``TextStreamer``): keep two offsets into the token ids, ``prefix_offset`` and
``read_offset``. ``prefix_text = decode(ids[prefix:read])`` is text already emitted; ``new_text =
decode(ids[prefix:])``. The new characters are ``new_text[len(prefix_text):]``. Decoding with a few tokens of
left context keeps tokenizers that drop a leading space at the start of a decode (SentencePiece ``Metaspace``)
correct, and while ``new_text`` ends with U+FFFD the last token(s) end inside a multi-byte UTF-8 character, so
nothing is emitted until the character is complete. Only the window ``ids[prefix:]`` is kept and decoded, so each
token costs O(window), not O(output length).

Stop strings: after each token every stop string is searched for only where a match could end in the new
characters, i.e. in the new characters plus the ``len(stop) - 1`` before them, so a token costs
O(number of stop strings x (new characters + longest stop string)), never O(output length); the earliest match
wins. The text is cut right before it (or right after it with ``include_stop_str_in_output``). Deltas never
contain text past a stop string: the last ``max(len(stop)) - 1`` characters are held back until the next token
decides them (vLLM's ``stop_buffer_length``; none with ``include_stop_str_in_output``). ``check_stop_strings``
bounds the number and length of stop strings a request may carry (``EngineArgs.max_stop_strings`` /
``max_stop_string_len``), which bounds that per-token cost.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

# Tokens of prompt context decoded before the first output token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool,
                   spaces_between_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """``ids -> str`` for a ``tokenizers.Tokenizer`` or a transformers tokenizer.

    For transformers fast tokenizers the Rust ``backend_tokenizer`` is used directly: it is faster and never
    applies ``clean_up_tokenization_spaces`` (which would make window decodes differ from a full decode).
    ``spaces_between_special_tokens=False`` (only meaningful when special tokens are kept, as vLLM): added tokens
    are written as they are, with the text between them decoded separately, and the pieces joined without spaces
    (vLLM's and transformers' slow-tokenizer rule; decoders that join tokens with spaces would put spaces there).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decode_batch") and hasattr(tokenizer, "id_to_token"):
        backend = tokenizer  # already a tokenizers.Tokenizer
    if backend is not None:
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    elif hasattr(tokenizer, "decode"):
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    else:
        raise ValueError(f"tokenizer must be a tokenizers.Tokenizer or a transformers tokenizer, got {type(tokenizer)}")
    if spaces_between_special_tokens or skip_special_tokens:
        return decode
    added_tokens = (backend.get_added_tokens_decoder() if backend is not None
                    else getattr(tokenizer, "added_tokens_decoder", {}))
    added = {int(token_id): getattr(token, "content", str(token)) for token_id, token in added_tokens.items()}
    if not added:
        return decode

    def decode_without_spaces(ids: list[int]) -> str:
        pieces, run = [], []
        for token_id in ids:
            if token_id in added:
                if run:
                    pieces.append(decode(run))
                    run = []
                pieces.append(added[token_id])
            else:
                run.append(token_id)
        if run:
            pieces.append(decode(run))
        return "".join(pieces)

    return decode_without_spaces


def check_stop_strings(stop: Sequence[str], *, max_stop_strings: int, max_stop_string_len: int) -> None:
    """Refuse stop strings beyond the engine's limits (their per-token search cost grows with count x length).

    Raises:
      ValueError naming ``stop``: more than ``max_stop_strings`` strings, or one longer than
        ``max_stop_string_len`` characters.
    """
    if len(stop) > max_stop_strings:
        raise ValueError(f"stop: at most {max_stop_strings} stop strings are allowed, got {len(stop)} "
                         f"(engine argument max_stop_strings)")
    longest = max((len(stop_str) for stop_str in stop), default=0)
    if longest > max_stop_string_len:
        raise ValueError(f"stop: a stop string may have at most {max_stop_string_len} characters, got one of "
                         f"{longest} (engine argument max_stop_string_len)")


class IncrementalDetokenizer:
    """Turns output token ids into text deltas, applying stop strings.

    Args:
      tokenizer: ``tokenizers.Tokenizer`` or transformers tokenizer.
      prompt_token_ids: the prompt; its last ``INITIAL_PREFIX_TOKENS`` ids are decoding context (not output).
      skip_special_tokens: drop special tokens from the text.
      spaces_between_special_tokens: False: no spaces around kept added tokens (``make_decode_fn``).
      stop: stop strings (non-empty).
      include_stop_str_in_output: keep the stop string at the end of the text.
      min_tokens: stop strings are not checked until more than this many output tokens exist (vLLM).

    Attributes:
      text: full output text so far (cut at the stop string), including a held-back tail not yet in any delta.
      emitted_text: concatenation of all deltas returned so far (== ``text`` once finished or stopped).
      stop_reason: the stop string that fired, or None.
      num_stop_chars_searched: characters searched for stop strings so far (work counter: each token adds at most
        ``len(stop) * (new characters + max(len(stop)) - 1)``).
      num_output_tokens: output tokens consumed (tokens after a firing stop string in the same ``append`` call
        are not consumed).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        stop_strings = list(stop or [])
        for stop_str in stop_strings:
            if not isinstance(stop_str, str) or not stop_str:
                raise ValueError(f"stop must contain non-empty strings, got {stop_str!r}")
        self._decode = make_decode_fn(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._stop = stop_strings
        # vLLM's stop_buffer_length: characters that may still turn out to start a stop string.
        self._stop_window = max((len(s) for s in stop_strings), default=1) - 1
        self.num_stop_chars_searched = 0
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        prompt_tail = [int(token_id) for token_id in prompt_token_ids[-INITIAL_PREFIX_TOKENS:]]
        # The decode window: ids[prefix_offset:] of the conceptual prompt+output sequence; _read_offset is relative.
        self._window: list[int] = prompt_tail
        self._read_offset = len(prompt_tail)
        self._prefix_text: str | None = None  # cache of decode(window[:read_offset])
        self.text = ""
        self._emitted_len = 0
        self.stop_reason: str | None = None
        self.num_output_tokens = 0
        self._finished = False

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted_len]

    def emitted_since(self, start: int) -> str:
        """``emitted_text[start:]`` without copying what came before ``start`` (a per-step call)."""
        return self.text[start:self._emitted_len]

    @property
    def finished(self) -> bool:
        return self._finished or self.stop_reason is not None

    def _decode_new_chars(self, force: bool) -> str:
        """Characters that the tokens after ``read_offset`` add; "" while they end inside a UTF-8 character."""
        if self._read_offset == len(self._window):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(self._window)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not force):
            return ""
        new_chars = new_text[len(prefix_text) :]
        # Slide the window: what was read becomes the new prefix context.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = None
        return new_chars

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """Earliest stop string match that ends after ``old_len`` (i.e. involves new characters)."""
        best: tuple[int, str] | None = None
        text_len = len(self.text)
        for stop_str in self._stop:
            start = max(0, old_len - len(stop_str) + 1)
            self.num_stop_chars_searched += text_len - start
            index = self.text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        return best

    def _add_text(self, new_chars: str) -> None:
        old_len = len(self.text)
        self.text += new_chars
        if not self._stop or self.num_output_tokens <= self._min_tokens:
            return
        match = self._find_stop(old_len)
        if match is not None:
            index, stop_str = match
            self.text = self.text[: index + len(stop_str) if self._include_stop else index]
            self.stop_reason = stop_str

    def _held_back_len(self) -> int:
        """Characters at the end of ``text`` not released yet: ``max(len(stop)) - 1`` while unfinished."""
        if self._include_stop or self.finished:
            return 0
        return self._stop_window

    def _release(self) -> str:
        release_to = max(self._emitted_len, len(self.text) - self._held_back_len())
        delta = self.text[self._emitted_len : release_to]
        self._emitted_len = release_to
        return delta

    def append(self, token_ids: Sequence[int], *, finished: bool = False) -> tuple[str, str | None]:
        """Consume new output tokens.

        Args:
          token_ids: new output ids (usually one per step).
          finished: the sequence ends with these tokens (length / EOS / stop id): release everything, including a
            trailing incomplete UTF-8 character (as U+FFFD, matching a full decode).
        Returns:
          (delta_text, stop_str): text to append to what was emitted before, and the stop string if one fired
          (the sequence is then finished; later calls raise RuntimeError).
        """
        if self.finished:
            raise RuntimeError("append() called on a finished detokenizer")
        for token_id in token_ids:
            self._window.append(int(token_id))
            self.num_output_tokens += 1
            new_chars = self._decode_new_chars(force=False)
            if new_chars:
                self._add_text(new_chars)
                if self.stop_reason is not None:
                    break
        if finished and self.stop_reason is None:
            self._finish()
        return self._release(), self.stop_reason

    def _finish(self) -> None:
        new_chars = self._decode_new_chars(force=True)
        if new_chars:
            self._add_text(new_chars)
        self._finished = True

    def flush(self) -> str:
        """Finish the sequence (e.g. aborted, or stopped by the engine) and return the held-back text."""
        if not self.finished:
            self._finish()
        return self._release()
