"""The prefix hash chain: `h_i = H(h_{i-1}, tokens_i, extra_keys_i)`.

Design choice: a block's hash names its whole prefix, not just its own tokens,
so two requests share block i only if they agree on every token (and every
extra key) before it; this is where "only a contiguous prefix can hit" comes
from. Only full blocks are hashed. The rejected alternative, hashing each block
on its own, would let a block hit under a different prefix and serve wrong KV.

Hash functions, named as vLLM names them:
- `sha256_cbor`: sha256 over the canonical CBOR encoding of
  `(parent, token_ids, extra_keys)`; stable across processes and machines.
- `sha256`: sha256 over the pickle of the same tuple (vLLM's older default).
- `builtin`: Python's `hash()` of the tuple; fast, but equal across processes
  only when they run under the same `PYTHONHASHSEED`.

`NONE_HASH`, the parent of the first block, is derived from a seed string, so
that every party that agrees on the seed agrees on the chain.

Extra keys, in vLLM's order: the LoRA name, then one key per multimodal input
overlapping the block (its identifier and its offset relative to the block),
then `cache_salt` on the first block only (it isolates tenants; on every block
it would be redundant since the chain carries it). None when there are none.
Each key is tagged with its kind (`("lora", name)`, `("mm", identifier,
offset)`, `("cache_salt", salt)`, as vLLM does since 0.31): untagged, a LoRA
named "t" and a cache_salt "t" would give the same first block, and a salted
request would hit another tenant's LoRA KV.

vLLM compatibility (checked against vLLM 0.33 by `kvspec hashes`): with
`seed=VLLM_NONE_HASH_SEED` (vLLM's seed when `PYTHONHASHSEED` is unset; under
`PYTHONHASHSEED=s` vLLM's seed is `s`) and `lora_path` given, the `sha256` and
`sha256_cbor` chains equal vLLM's, whose LoRA key is `("lora", name, path)`.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import cbor2

from kvspec.spec.errors import InvalidRequest
from kvspec.spec.state import BlockHash

__all__ = [
    "DEFAULT_HASH_FN",
    "DEFAULT_SEED",
    "HASH_FUNCTIONS",
    "VLLM_NONE_HASH_SEED",
    "ExtraKey",
    "MultiModalInput",
    "block_extra_keys",
    "hash_block_tokens",
    "hash_request_blocks",
    "none_hash",
]

# ("lora", name), ("lora", name, path), ("mm", identifier, offset), ("cache_salt", salt)
ExtraKey = tuple[str, str] | tuple[str, str, int] | tuple[str, str, str]
HashInput = tuple[object, tuple[int, ...], tuple[ExtraKey, ...] | None]


def _sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _sha256_pickle(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _builtin(value: object) -> bytes:
    return hash(value).to_bytes(8, "big", signed=True)


# Each function maps the hashed tuple to the digest bytes.
HASH_FUNCTIONS: dict[str, Callable[[object], bytes]] = {
    "sha256_cbor": _sha256_cbor,
    "sha256": _sha256_pickle,
    "builtin": _builtin,
}
DEFAULT_HASH_FN = "sha256_cbor"
# NOTE: a fixed seed string, so that sha256 chains agree across processes by
# default; a caller who wants per-deployment isolation passes its own seed.
DEFAULT_SEED = "kvspec"
# vLLM's NONE_HASH seed for sha256 and sha256_cbor when PYTHONHASHSEED is unset (0.29+).
VLLM_NONE_HASH_SEED = "vllm-none-hash"


def _hash_fn(name: str) -> Callable[[object], bytes]:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(HASH_FUNCTIONS))
        raise InvalidRequest(f"unknown hash_fn={name!r}; known: {known}") from None


def _chain_value(block_hash: BlockHash, hash_fn: str) -> object:
    # The builtin hash chains on ints (as vLLM's did), the others on bytes.
    if hash_fn == "builtin":
        return int.from_bytes(block_hash, "big", signed=True)
    return bytes(block_hash)


def none_hash(hash_fn: str = DEFAULT_HASH_FN, seed: str = DEFAULT_SEED) -> BlockHash:
    """The parent hash of a request's first block, derived from `seed`.

    >>> none_hash("sha256_cbor", "a") == none_hash("sha256_cbor", "a") != none_hash("sha256_cbor", "b")
    True
    """
    return BlockHash(_hash_fn(hash_fn)(seed))


def hash_block_tokens(
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple[ExtraKey, ...] | None,
    hash_fn: str = DEFAULT_HASH_FN,
) -> BlockHash:
    """The hash of one full block, chained on its parent's hash.

    >>> p = none_hash()
    >>> hash_block_tokens(p, [1, 2], None) == hash_block_tokens(p, (1, 2), None)
    True
    >>> hash_block_tokens(p, [1, 2], None) == hash_block_tokens(p, [1, 2], (("lora", "a"),))
    False
    """
    return _block_hash(parent, tuple(token_ids), extra_keys, hash_fn)


# A pure function of its arguments, asked again and again for the same blocks
# (every step of a running request hashes its whole prefix again, in the spec,
# in each implementation and in the harness): remembered, each step hashes only
# its new full blocks.
@lru_cache(maxsize=1 << 16)
def _block_hash(
    parent: BlockHash, token_ids: tuple[int, ...], extra_keys: tuple[ExtraKey, ...] | None, hash_fn: str
) -> BlockHash:
    value: HashInput = (_chain_value(parent, hash_fn), token_ids, extra_keys)
    return BlockHash(_hash_fn(hash_fn)(value))


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """A multimodal input embedded in the prompt at token positions [offset, offset + length)."""

    identifier: str  # the content hash of the input (image, audio, ...)
    offset: int  # the first token position it occupies
    length: int  # how many token positions it occupies


def block_extra_keys(
    start: int,
    end: int,
    lora_name: str | None = None,
    mm_inputs: Sequence[MultiModalInput] = (),
    cache_salt: str | None = None,
    lora_path: str | None = None,
) -> tuple[ExtraKey, ...] | None:
    """The extra keys of the block covering token positions [start, end).

    `lora_path`, when given, joins the LoRA key as vLLM's does since 0.31
    (re-pointing a LoRA name at another adapter then misses).

    >>> block_extra_keys(0, 4, cache_salt="t1"), block_extra_keys(4, 8, cache_salt="t1")
    ((('cache_salt', 't1'),), None)
    >>> block_extra_keys(4, 8, "l", [MultiModalInput("img", 6, 5)])
    (('lora', 'l'), ('mm', 'img', 2))
    >>> block_extra_keys(0, 4, "l", lora_path="/a")
    (('lora', 'l', '/a'),)
    """
    keys: list[ExtraKey] = []
    if lora_name and lora_path is not None:
        keys.append(("lora", lora_name, lora_path))
    elif lora_name:
        keys.append(("lora", lora_name))
    for mm in mm_inputs:
        if mm.offset < end and start < mm.offset + mm.length:
            keys.append(("mm", mm.identifier, mm.offset - start))
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    mm_inputs: Sequence[MultiModalInput] = (),
    cache_salt: str | None = None,
    hash_fn: str = DEFAULT_HASH_FN,
    seed: str = DEFAULT_SEED,
    lora_path: str | None = None,
) -> tuple[BlockHash, ...]:
    """The hash chain of every full block of a request; a partial last block gets none.

    `lora_path`: see `block_extra_keys`.

    Raises:
        InvalidRequest: block_size is not a positive integer.

    >>> len(hash_request_blocks(list(range(10)), 4))
    2
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidRequest(f"block_size must be a positive integer; got block_size={block_size!r}")
    args = (tuple(token_ids), block_size, lora_name, tuple(mm_inputs), cache_salt, hash_fn, seed, lora_path)
    try:
        return _request_chain(*args)
    except TypeError:  # a key that cannot be remembered (unhashable): computed without the memo
        return _request_chain.__wrapped__(*args)


# The same request's chain is asked for by the spec, the implementation and the harness at every
# step: remembered whole (and block by block, `_block_hash`, for the chain of a request that grew).
@lru_cache(maxsize=4096)
def _request_chain(
    token_ids: tuple[int, ...],
    block_size: int,
    lora_name: str | None,
    mm_inputs: tuple[MultiModalInput, ...],
    cache_salt: str | None,
    hash_fn: str,
    seed: str,
    lora_path: str | None,
) -> tuple[BlockHash, ...]:
    parent = none_hash(hash_fn, seed)
    hashes: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        extra = block_extra_keys(start, end, lora_name, mm_inputs, cache_salt, lora_path)
        parent = hash_block_tokens(parent, token_ids[start:end], extra, hash_fn)
        hashes.append(parent)
    return tuple(hashes)
