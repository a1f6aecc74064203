"""--generation-config auto|vllm|DIR: the checkpoint's sampling defaults, read as vLLM reads them."""

import json

import pytest

from paged_jax.engine.generation_config import eos_token_ids, read_generation_config, sampling_defaults


def write(directory, config):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_auto_reads_the_model_directory(tmp_path):
    model = write(tmp_path / "model", {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1,
                                       "max_new_tokens": 64, "eos_token_id": [1, 2], "do_sample": True})
    config = read_generation_config("auto", model)
    assert sampling_defaults(config) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1,
                                        "max_tokens": 64}
    assert eos_token_ids(config) == [1, 2]


def test_vllm_mode_ignores_the_file_and_a_directory_mode_reads_another(tmp_path):
    model = write(tmp_path / "model", {"temperature": 0.6})
    other = write(tmp_path / "other", {"top_p": 0.5, "eos_token_id": 7})
    assert read_generation_config("vllm", model) == {}
    config = read_generation_config(str(other), model)
    assert sampling_defaults(config) == {"top_p": 0.5} and eos_token_ids(config) == [7]


def test_missing_file(tmp_path):
    assert read_generation_config("auto", tmp_path) == {} and read_generation_config("auto", None) == {}
    with pytest.raises(ValueError, match="generation_config"):
        read_generation_config(str(tmp_path / "nowhere"), None)
