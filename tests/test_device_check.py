"""A visible GPU with a CPU-only JAX is a loud warning at start-up."""

import logging

import jax

from paged_jax.worker import device_check


def test_warns_when_a_gpu_is_visible_but_jax_runs_on_cpu(monkeypatch, caplog):
    monkeypatch.setattr(device_check, "visible_nvidia_gpus", lambda: ["/dev/nvidia0"])
    monkeypatch.setenv("JAX_PLATFORMS", "")
    assert jax.default_backend() == "cpu"
    with caplog.at_level(logging.WARNING, logger="paged_jax.worker.device_check"):
        assert device_check.warn_if_gpu_unused()
    assert "JAX has no GPU backend" in caplog.text and "paged-jax[cuda13]" in caplog.text


def test_silent_without_gpu_or_when_cpu_is_asked_for(monkeypatch, caplog):
    monkeypatch.setenv("JAX_PLATFORMS", "")
    monkeypatch.setattr(device_check, "visible_nvidia_gpus", lambda: [])
    assert not device_check.warn_if_gpu_unused()
    monkeypatch.setattr(device_check, "visible_nvidia_gpus", lambda: ["/dev/nvidia0"])
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not device_check.warn_if_gpu_unused()
    assert caplog.text == ""
