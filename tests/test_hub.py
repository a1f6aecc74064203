"""Hub repo ids resolve through huggingface_hub's cache layout (these machines have no network: HF_HUB_OFFLINE)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.hub import resolve_checkpoint
from models.testing import write_hub_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    write_hub_cache(cache, "acme/tiny", {
        COMMIT: {"config.json": json.dumps({"v": 1}).encode(), "model.safetensors": b"w1"},
        OTHER_COMMIT: {"config.json": json.dumps({"v": 2}).encode(), "model.safetensors": b"w2"},
    }, {"main": COMMIT, "v2": OTHER_COMMIT})
    write_hub_cache(cache, "acme/binonly", {COMMIT: {"config.json": b"{}", "tokenizer.json": b"{}"}},
                   {"main": COMMIT})
    write_hub_cache(cache, "acme/eagle-head", {COMMIT: {"config.json": b"{}", "pytorch_model.bin": b"w"}},
                   {"main": COMMIT})
    return cache


def test_local_directory_is_returned_as_is(tmp_path):
    assert resolve_checkpoint(tmp_path) == tmp_path


def test_local_directory_with_revision_is_refused(tmp_path):
    with pytest.raises(ValueError, match="revision"):
        resolve_checkpoint(tmp_path, revision="main")


def test_repo_id_resolves_to_its_snapshot(offline_cache):
    path = resolve_checkpoint("acme/tiny", download_dir=str(offline_cache))
    assert path.name == COMMIT
    assert json.loads((path / "config.json").read_text()) == {"v": 1}


def test_revision_selects_the_snapshot(offline_cache):
    for revision in ("v2", OTHER_COMMIT):
        path = resolve_checkpoint("acme/tiny", revision=revision, download_dir=str(offline_cache))
        assert json.loads((path / "config.json").read_text()) == {"v": 2}


def test_hf_home_is_the_default_cache(offline_cache):
    # huggingface_hub reads HF_HOME at import, so resolve in a fresh interpreter.
    env = {**os.environ, "HF_HOME": str(offline_cache.parent), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", "from models.hub import resolve_checkpoint as r; print(r('acme/tiny'))"],
                         env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == str(offline_cache / "models--acme--tiny" / "snapshots" / COMMIT)


def test_uncached_repo_offline_names_the_field(offline_cache):
    with pytest.raises(ValueError, match="tokenizer 'acme/missing'.*HF_HUB_OFFLINE"):
        resolve_checkpoint("acme/missing", download_dir=str(offline_cache), what="tokenizer", field="tokenizer")


def test_repo_without_safetensors_is_refused_for_weights_not_for_tokenizer(offline_cache):
    with pytest.raises(ValueError, match="no safetensors"):
        resolve_checkpoint("acme/binonly", download_dir=str(offline_cache))
    assert resolve_checkpoint("acme/binonly", download_dir=str(offline_cache), what="tokenizer").name == COMMIT


def test_draft_head_repo_may_ship_a_pytorch_bin_only(offline_cache):
    path = resolve_checkpoint("acme/eagle-head", download_dir=str(offline_cache), what="draft_head",
                              field="speculative_config.model")
    assert (path / "pytorch_model.bin").read_bytes() == b"w"
    with pytest.raises(ValueError, match="speculative_config.model 'acme/binonly' has no weights"):
        resolve_checkpoint("acme/binonly", download_dir=str(offline_cache), what="draft_head",
                           field="speculative_config.model")


def test_nonexistent_path_that_is_no_repo_id(tmp_path):
    with pytest.raises(ValueError, match="neither a local directory nor"):
        resolve_checkpoint(str(tmp_path / "a" / "b" / "c"))


def test_engine_resolves_hub_ids_and_dummy_shapes(offline_cache):
    from paged_jax.config import EngineArgs
    from paged_jax.worker.model_loader import resolve_model

    path, config = resolve_model(EngineArgs(model="acme/tiny", download_dir=str(offline_cache)))
    assert path.endswith(COMMIT) and config is None
    path, _ = resolve_model(EngineArgs(model="acme/tiny", revision="v2", download_dir=str(offline_cache)))
    assert path.endswith(OTHER_COMMIT)
    # Random weights need no weight files: a repo without safetensors still gives its config.
    path, _ = resolve_model(EngineArgs(model="acme/binonly", load_format="dummy", download_dir=str(offline_cache)))
    assert path.endswith(COMMIT)
    # A named shape needs no checkpoint at all.
    path, config = resolve_model(EngineArgs(model="qwen3-0.6b", load_format="dummy"))
    assert path is None and config.hidden_size == 1024
    with pytest.raises(ValueError, match="model 'acme/missing'"):
        resolve_model(EngineArgs(model="acme/missing", download_dir=str(offline_cache)))
