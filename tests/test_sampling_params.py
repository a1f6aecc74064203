"""SamplingParams: vLLM defaults, normalisation and validation (each bad field raises ValueError naming it)."""

import numpy as np
import pytest

from paged_jax.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType, validate_token_ids


def test_defaults_match_vllm():
    params = SamplingParams()
    assert params.n == 1
    assert params.best_of is None
    assert params.presence_penalty == 0.0
    assert params.frequency_penalty == 0.0
    assert params.repetition_penalty == 1.0
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.min_p == 0.0
    assert params.seed is None
    assert params.stop is None and params.stop_strings == []
    assert params.stop_token_ids is None
    assert params.ignore_eos is False
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.logprobs is None
    assert params.prompt_logprobs is None
    assert params.skip_special_tokens is True
    assert params.spaces_between_special_tokens is True
    assert params.include_stop_str_in_output is False
    assert params.detokenize is True
    assert params.sampling_type == SamplingType.RANDOM
    assert not params.uses_penalties and not params.uses_truncation


def test_stop_string_is_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop="###").stop_strings == ["###"]


def test_sampling_type_and_greedy_threshold():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == SamplingType.RANDOM_SEED
    # Greedy requests never need truncation, whatever top-k/top-p say.
    assert not SamplingParams(temperature=0.0, top_k=5, top_p=0.5).uses_truncation
    assert SamplingParams(top_k=5).uses_truncation
    assert SamplingParams(top_p=0.9).uses_truncation
    assert SamplingParams(min_p=0.1).uses_truncation
    assert SamplingParams(repetition_penalty=1.1).uses_penalties


def test_valid_edge_values_are_accepted():
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, max_tokens=None,
                   min_tokens=5, logprobs=0, temperature=0, seed=-7)
    SamplingParams(logprobs=MAX_LOGPROBS, stop_token_ids=[0, 5], max_tokens=1, min_tokens=1)
    SamplingParams(max_tokens=None, min_tokens=1000)


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"n": 0}, "n"),
        ({"best_of": 0}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"best_of": 2, "temperature": 0.0}, "best_of"),  # greedy: every sequence would be the same
        ({"best_of": 1, "n": 2}, "best_of"),  # vLLM V0: best_of >= n
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1.0}}, "logit_bias"),
        ({"logit_bias": {1: "big"}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
        ({"bad_words": ["ok", ""]}, "bad_words"),
        ({"bad_words": ["ok", 3]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
    ],
)
def test_invalid_field_raises_value_error_naming_it(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        SamplingParams(**kwargs)


def test_error_message_shows_the_value():
    with pytest.raises(ValueError, match=r"max_tokens must be at least 1, got -1"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_clone_is_independent():
    params = SamplingParams(stop=["x"], stop_token_ids=[3], temperature=0.5, logit_bias={1: 2.0},
                            allowed_token_ids=[1, 2], bad_words=["no"])
    params.update_from_tokenizer(_WordTokenizer())
    copy = params.clone()
    assert copy == params and copy.bad_words_token_ids == params.bad_words_token_ids
    copy.stop.append("y")
    copy.stop_token_ids.append(4)
    copy.logit_bias[5] = 1.0
    copy.allowed_token_ids.append(3)
    copy.bad_words.append("never")
    copy.bad_words_token_ids[0].append(9)
    assert params.stop == ["x"] and params.stop_token_ids == [3] and params.logit_bias == {1: 2.0}
    assert params.allowed_token_ids == [1, 2] and params.bad_words == ["no"]
    assert params.bad_words_token_ids == [[10], [20]]


def test_best_of_at_least_n_is_accepted():
    assert SamplingParams(n=3, best_of=3).best_of == 3
    params = SamplingParams(n=2, best_of=5)
    assert params.num_sequences == 5 and params.sampled_logprobs == 0  # ranked by cumulative logprob


def test_logit_bias_keys_become_ints_and_biases_are_clamped():
    params = SamplingParams(logit_bias={"42": 5, 7: -250.0, "8": 100.5})
    assert params.logit_bias == {42: 5.0, 7: -100.0, 8: 100.0}
    assert params.uses_bias_table and not SamplingParams(logit_bias={}).uses_bias_table
    assert SamplingParams(allowed_token_ids=[3]).uses_bias_table and not SamplingParams().uses_bias_table


class _WordTokenizer:
    """Each space-separated word is one token; a word with a leading space gets another id (as BPE tokenizers do)."""

    ids = {"no": 10, " no": 20, "bad": 11, " bad": 21, "word": 12, " word": 12}

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        words = text.split(" ")
        pieces = [words[0]] + [" " + w for w in words[1:]] if words[0] else [" " + w for w in words[1:]]
        return [self.ids[piece] for piece in pieces]


def test_bad_words_are_tokenized_with_and_without_a_leading_space():
    params = SamplingParams(bad_words=["no", " bad word"])
    assert params.bad_words_token_ids == [] and not params.reads_output_tokens  # until the engine tokenizes
    params.update_from_tokenizer(_WordTokenizer())
    # "bad word" -> [11, 12]; " bad word" -> [21, 12]; duplicates would be dropped.
    assert params.bad_words_token_ids == [[10], [20], [11, 12], [21, 12]]
    assert params.reads_output_tokens  # a two-token word: the next ban depends on the last output token
    single = SamplingParams(bad_words=["no"])
    single.update_from_tokenizer(_WordTokenizer())
    assert not single.reads_output_tokens


def test_validate_token_ids():
    validate_token_ids([0, 5, 9], vocab_size=10)
    validate_token_ids(np.array([1, 2], np.int32), vocab_size=10)
    with pytest.raises(ValueError, match=r"prompt token id 10 at position 1 is out of range \[0, 10\)"):
        validate_token_ids([3, 10], vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        validate_token_ids([-1], vocab_size=10, field="stop_token_ids")
    with pytest.raises(ValueError, match="prompt token ids must be ints"):
        validate_token_ids([1.0], vocab_size=10)
