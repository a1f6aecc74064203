#!/bin/sh
# The image's entrypoint: `paged-jax serve` on every interface, with JAX's compilation cache in the cache volume
# (a restarted container skips the compile). Its arguments are serve's: a model (Hub id or directory; none = the
# built-in SmolLM2-135M-Instruct) and flags. Later flags win, so `--host` or `--compilation-cache-dir` given here
# override these defaults.
set -e
exec paged-jax serve --host 0.0.0.0 \
    --compilation-cache-dir "${PAGED_JAX_CACHE:-$HOME/.cache/paged_jax}/jax_cache" "$@"
