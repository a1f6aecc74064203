"""IncrementalDetokenizer with real tokenizers: deltas == full decode, no partial UTF-8, exact stop strings."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paged_jax.engine.detokenizer import IncrementalDetokenizer

SMOLLM2_DIR = Path.home() / ".cache" / "paged_jax" / "SmolLM2-135M-Instruct"
CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. STOP here and there.",
    "Once upon a time there was a model that generated text one token at a time.",
] * 20
SAMPLE_TEXT = "Hello world! Café 😀 naïve 中文字符 and 🎉🎉 done. The fox STOPS here, ok?"


def _byte_level_bpe() -> Tokenizer:
    """GPT-2 style byte-level BPE: emoji / CJK are split into byte tokens (partial UTF-8 characters)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _metaspace_byte_fallback_bpe() -> Tokenizer:
    """Llama-2 / SentencePiece style: '▁' for spaces, a leading space stripped on decode, <0xNN> byte fallback."""
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<eos>"], limit_alphabet=50, show_progress=False)
    base.train_from_iterator(CORPUS, trainer)
    vocab = base.get_vocab()
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(merge) for merge in json.loads(base.to_str())["model"]["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tokenizer.add_special_tokens(["<eos>"])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def _smollm2():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))


TOKENIZER_FACTORIES = {"byte_level_bpe": _byte_level_bpe, "metaspace_byte_fallback": _metaspace_byte_fallback_bpe}
if (SMOLLM2_DIR / "tokenizer.json").is_file():
    TOKENIZER_FACTORIES["smollm2"] = _smollm2


@pytest.fixture(scope="module", params=sorted(TOKENIZER_FACTORIES))
def tokenizer(request):
    return TOKENIZER_FACTORIES[request.param]()


def _encode(tokenizer, text):
    encoded = tokenizer.encode(text)
    return list(encoded.ids if hasattr(encoded, "ids") else encoded)


def _decode(tokenizer, ids, skip_special_tokens=True):
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def _expected_output_text(tokenizer, prompt_ids, output_ids):
    """The output's text as it appears after the prompt in a decode of the whole sequence."""
    full = _decode(tokenizer, prompt_ids + output_ids)
    prompt_text = _decode(tokenizer, prompt_ids)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


def _stream(detokenizer, output_ids, chunk=1):
    deltas = []
    stop_str = None
    for start in range(0, len(output_ids), chunk):
        delta, stop_str = detokenizer.append(output_ids[start:start + chunk])
        deltas.append(delta)
        if stop_str is not None:
            break
    if stop_str is None:
        deltas.append(detokenizer.flush())
    return deltas, stop_str


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("with_prompt", [False, True])
def test_deltas_concatenate_to_full_decode(tokenizer, chunk, with_prompt):
    prompt_ids = _encode(tokenizer, "Once upon a time") if with_prompt else []
    output_ids = _encode(tokenizer, SAMPLE_TEXT)
    # The text must really contain characters split over several tokens, or the test proves nothing.
    assert any("\ufffd" in _decode(tokenizer, [token]) for token in output_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, stop_str = _stream(detokenizer, output_ids, chunk)
    expected = _expected_output_text(tokenizer, prompt_ids, output_ids) if with_prompt else _decode(tokenizer, output_ids)
    assert stop_str is None
    assert "".join(deltas) == expected
    assert detokenizer.text == expected == detokenizer.emitted_text
    assert all("\ufffd" not in delta for delta in deltas)
    assert detokenizer.num_output_tokens == len(output_ids)


def _find_spanning_stop(tokenizer, output_ids):
    """A stop string made of the tail of one token's text and the head of the next one's."""
    for index in range(len(output_ids) - 1):
        left = _decode(tokenizer, output_ids[: index + 1])
        both = _decode(tokenizer, output_ids[: index + 2])
        right = both[len(left):]
        if not both.startswith(left):
            continue
        tail = left[-2:] if left[-2:].isalpha() else left[-1:]
        head = right[:2] if right[:2].isalpha() else right[:1]
        stop = tail + head
        if tail.isalpha() and head.isalpha() and len(stop) >= 3:
            if _decode(tokenizer, output_ids).find(stop) == len(left) - len(tail):
                return stop
    raise AssertionError("no token boundary inside a word found")


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_spanning_two_tokens_cuts_exactly(tokenizer, include_stop):
    output_ids = _encode(tokenizer, SAMPLE_TEXT)
    full_text = _decode(tokenizer, output_ids)
    stop = _find_spanning_stop(tokenizer, output_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["never-there", stop],
                                         include_stop_str_in_output=include_stop)
    deltas, stop_str = _stream(detokenizer, output_ids)
    cut = full_text.find(stop) + (len(stop) if include_stop else 0)
    assert stop_str == stop and detokenizer.stop_reason == stop
    assert "".join(deltas) == full_text[:cut] == detokenizer.text
    assert detokenizer.num_output_tokens < len(output_ids)
    with pytest.raises(RuntimeError):
        detokenizer.append(output_ids[-1:])


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_strings_cut_text_and_never_leak(tokenizer, include_stop):
    prompt_ids = _encode(tokenizer, "The quick brown fox")
    output_ids = _encode(tokenizer, SAMPLE_TEXT)
    full_text = _expected_output_text(tokenizer, prompt_ids, output_ids)
    stops = ["STOP", "中文", "🎉"]  # earliest in the text wins, not the first in the list
    first_index, first_stop = min((full_text.find(s), s) for s in stops)
    assert first_stop == "中文"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stops, include_stop_str_in_output=include_stop)
    emitted = ""
    for token in output_ids:
        delta, stop_str = detokenizer.append([token])
        emitted += delta
        # At no point may the released text run past the start of the stop string (or its end when included).
        limit = first_index + (len(first_stop) if include_stop else 0)
        assert full_text[:limit].startswith(emitted)
        if stop_str is not None:
            break
    assert stop_str == first_stop
    assert emitted == full_text[: first_index + (len(first_stop) if include_stop else 0)]


def test_partial_stop_string_is_held_back_then_released(tokenizer):
    output_ids = _encode(tokenizer, " The fox STOPS here")
    full_text = _decode(tokenizer, output_ids)
    # "STOP!" never occurs, but "STOP" is a prefix of it: those characters wait until they are ruled out.
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["STOP!"])
    emitted = ""
    for token in output_ids:
        emitted += detokenizer.append([token])[0]
        if detokenizer.text.endswith("STOP"):
            assert not emitted.endswith("S") and emitted == detokenizer.text[: -len("STOP")]
    emitted += detokenizer.flush()
    assert emitted == full_text and detokenizer.stop_reason is None


def test_finished_flag_releases_everything(tokenizer):
    output_ids = _encode(tokenizer, " Hello wor")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["world"])
    emitted = "".join(detokenizer.append([token])[0] for token in output_ids[:-1])
    delta, stop_str = detokenizer.append(output_ids[-1:], finished=True)
    assert stop_str is None
    assert emitted + delta == _decode(tokenizer, output_ids) == detokenizer.text
    assert detokenizer.flush() == ""


def test_min_tokens_delays_stop_string_check(tokenizer):
    output_ids = _encode(tokenizer, " Hello world Hello world")
    full_text = _decode(tokenizer, output_ids)
    first_hello_tokens = len(_encode(tokenizer, " Hello"))
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["Hello"], min_tokens=first_hello_tokens)
    deltas, stop_str = _stream(detokenizer, output_ids)
    assert stop_str == "Hello"
    # The first "Hello" came within min_tokens, so only the second one stops generation.
    assert "".join(deltas) == full_text[: full_text.index("Hello", 2)]


def test_special_tokens_skipped_or_kept():
    tokenizer = _byte_level_bpe()
    eos = tokenizer.token_to_id("<eos>")
    output_ids = _encode(tokenizer, " Hello world") + [eos]
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(_stream(skipped, output_ids)[0]) == " Hello world"
    assert "".join(_stream(kept, output_ids)[0]) == " Hello world<eos>"


def test_spaces_between_special_tokens():
    """A decoder that joins tokens with spaces (WordPiece) puts spaces around kept special tokens unless
    spaces_between_special_tokens=False (then the pieces are joined as they are, as vLLM); skipped special tokens
    make the option moot."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(["[A]", "[B]"])
    a, b = tokenizer.token_to_id("[A]"), tokenizer.token_to_id("[B]")
    output_ids = [1, a, b, 2]

    def text(**kwargs):
        return "".join(_stream(IncrementalDetokenizer(tokenizer, [], **kwargs), output_ids)[0])

    assert text(skip_special_tokens=False) == "hello [A] [B] world"
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == "hello[A][B]world"
    assert text(spaces_between_special_tokens=False) == text() == "hello world"


class _CountingTokenizer:
    """A transformers-like tokenizer (only ``decode``) that records how many ids each decode call sees."""

    def __init__(self, inner: Tokenizer):
        self.inner = inner
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        self.decoded_lengths.append(len(ids))
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_bounded():
    inner = _byte_level_bpe()
    counting = _CountingTokenizer(inner)
    prompt_ids = _encode(inner, "Once upon a time " * 20)
    output_ids = _encode(inner, SAMPLE_TEXT * 8)
    detokenizer = IncrementalDetokenizer(counting, prompt_ids)
    deltas, _ = _stream(detokenizer, output_ids)
    assert "".join(deltas) == _expected_output_text(inner, prompt_ids, output_ids)
    # Decode work per token does not grow with the output length (a 4-byte emoji spans at most 4 tokens).
    assert max(counting.decoded_lengths) <= 12
    assert len(counting.decoded_lengths) <= 2 * len(output_ids) + 2


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(_byte_level_bpe(), [], stop=[""])
