"""pdplane's own chained hashes of KV cache blocks (the prefix index's keys).

One function for everyone who must agree on block identity: the scheduler's prefix index
(from the token ids in the engines' KV events), the gateway (from a prompt's token ids) and the
simulator. The engines' own block hashes (vLLM's seed, algorithm and 64-bit truncation) never
leave the instance's stream: instances with different hash seeds still share our keys.

Definition (version 1), for a block size B and the full blocks of a token sequence:

    root      = BLAKE2b-64(b"pdplane-prefix-v1" + utf8(lora))
    h[i]      = BLAKE2b-64(key = h[i-1] (8 bytes, root for i = 0),
                           data = uint32-LE tokens[i*B : (i+1)*B] [+ b"\\0" + utf8(extra[i])])
    hash[i]   = int.from_bytes(h[i], "little")          # unsigned 64-bit

So a block's hash names its whole prefix (like vLLM's), the LoRA adapter (vLLM keys blocks by
adapter too) and any extra keys vLLM mixed in (multimodal inputs, cache salt). A trailing
partial block has no hash. BLAKE2b is in the standard library, keyed (so the chain is a MAC
chain, not a plain concatenation) and defined independently of the Python version.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["HASH_VERSION", "block_hashes", "root_hash"]

#: Bumped when the definition above changes; a subscriber and a gateway must agree on it.
HASH_VERSION = 1

_DIGEST = 8
_ROOTS: dict[str, bytes] = {}


def _root(lora: str) -> bytes:
    root = _ROOTS.get(lora)
    if root is None:
        root = hashlib.blake2b(b"pdplane-prefix-v1" + lora.encode(), digest_size=_DIGEST).digest()
        if len(_ROOTS) < 4096:  # bounded: adapter names are few
            _ROOTS[lora] = root
    return root


def root_hash(lora: str = "") -> int:
    """The chain's starting value for adapter `lora` ("" = base model), as an int."""
    return int.from_bytes(_root(lora), "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: int | None = None,
    lora: str = "",
    extra_keys: Sequence[str] | None = None,
) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `token_ids` (definition in the module doc).

    Args:
        token_ids: token ids (each 0 <= id < 2**32); only `len // block_size` full blocks count.
        block_size: tokens per block (> 0).
        parent: hash of the block before `token_ids[0]`; None = the sequence starts here.
        lora: LoRA adapter name ("" = base model); used only when `parent` is None.
        extra_keys: per full block, canonical text of the extra keys vLLM mixed into that
            block's hash ("" = none); None = none for any block.

    Returns:
        One unsigned 64-bit int per full block, in order.

    Raises:
        ValueError: block_size <= 0, a token id outside uint32, or fewer extra keys than blocks.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(token_ids) // block_size
    if n == 0:
        return []
    try:
        data = array("I", token_ids[: n * block_size]).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if extra_keys is not None and len(extra_keys) < n:
        raise ValueError(f"{len(extra_keys)} extra keys for {n} blocks")
    key = _root(lora) if parent is None else parent.to_bytes(_DIGEST, "little")
    view = memoryview(data)
    step = block_size * 4
    blake = hashlib.blake2b
    out: list[int] = []
    append = out.append
    for i in range(n):
        chunk = view[i * step : (i + 1) * step]
        if extra_keys is not None and extra_keys[i]:
            chunk = bytes(chunk) + b"\0" + extra_keys[i].encode()  # type: ignore[assignment]
        key = blake(chunk, digest_size=_DIGEST, key=key).digest()
        append(int.from_bytes(key, "little"))
    return out
