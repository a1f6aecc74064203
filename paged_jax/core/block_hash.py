"""The prefix cache's block hashes: a full block's hash chains its parent block's hash and its token ids, so equal
hashes mean equal token prefixes (``paged_jax.core.kv_cache_manager``); the first block's parent is the request's root
hash (its ``cache_salt`` and LoRA adapter)."""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

_ROOT_HASH = b""  # parent hash of a sequence's first block (no cache_salt)


def root_hash(cache_salt: str | None, lora_key: bytes | None = None) -> bytes:
    """Parent hash of a sequence's first block: with a ``cache_salt`` (vLLM's per-request field) every block hash of
    the sequence depends on it, so requests only share cached blocks when their salts are equal (tenant isolation:
    neither hits nor their latency reveal another tenant's prompts). ``lora_key`` (the request's adapter
    ``cache_key``) seeds it likewise: K/V computed under one adapter is never a hit for another or the base model."""
    if cache_salt is None:
        return _ROOT_HASH if lora_key is None else lora_key
    salted = hashlib.sha256(b"cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()
    return salted if lora_key is None else hashlib.sha256(salted + lora_key).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained block hash: sha256 over the parent block's hash and this block's token ids (int64 bytes).

    Collision resistance matters: a collision would hand one request another's K/V.
    """
    digest = hashlib.sha256(parent_hash)
    digest.update(array.array("q", token_ids).tobytes())  # int64, native order (numpy's bytes, built faster)
    return digest.digest()
