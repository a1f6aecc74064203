"""Start-up check of the JAX backend against the machine: a GPU that JAX cannot use is a loud warning, not a
silent CPU run."""

from __future__ import annotations

import glob
import logging
import os

import jax

logger = logging.getLogger(__name__)

GPU_INSTALL_HINT = ("pip install 'paged-jax[cuda13]' (CUDA 13 driver) or 'paged-jax[cuda12]', or `make serve`, "
                    "which picks the extra from nvidia-smi")


def visible_nvidia_gpus() -> list[str]:
    """Device nodes of the NVIDIA GPUs this process can see (``/dev/nvidia0``, ...)."""
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def warn_if_gpu_unused() -> bool:
    """Log a warning when an NVIDIA GPU is visible but JAX runs on the CPU (a CPU-only jaxlib, or a CUDA plugin
    that failed to load). Silent when ``JAX_PLATFORMS`` asks for the CPU on purpose. Returns whether it warned."""
    if jax.default_backend() != "cpu":
        return False
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    gpus = visible_nvidia_gpus()
    if not gpus:
        return False
    logger.warning("!" * 100)
    logger.warning("%d NVIDIA GPU(s) visible (%s) but JAX has no GPU backend: running on the CPU, very slowly. "
                   "Install JAX's CUDA wheels: %s", len(gpus), ", ".join(gpus), GPU_INSTALL_HINT)
    logger.warning("!" * 100)
    return True
