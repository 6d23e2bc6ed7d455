"""Mutants of the prefix hash chain: what a block's hash is keyed on.

`h_i = H(h_{i-1}, tokens_i, extra_keys_i)`: the parent makes a hit mean "the
whole prefix agrees", and the extra keys (LoRA, multimodal inputs, the
tenant's cache_salt on the first block) keep requests whose KV differs from
sharing blocks. Each manager below computes the chain with one ingredient
wrong; everything else is the reference's.

The harness compares hashes as an equality relation (which blocks share a
hash), so a mutant is visible when it makes two blocks share a hash that the
spec keeps apart, or the reverse.
"""

from __future__ import annotations

from kvspec.conformance.targets.builtin import ReferenceManagerAdapter
from kvspec.conformance.tools.mutants import Mutant
from kvspec.spec.hashing import ExtraKey, block_extra_keys, hash_block_tokens, hash_request_blocks, none_hash
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash

__all__ = ["MUTANTS"]


class ChainIgnoresParent(ReferenceManagerAdapter):
    """Each block is hashed with `NONE_HASH` as its parent: a block's hash names its own tokens only.

    Two requests that differ in their first block but agree in the second
    share the second block's hash, and one hits KV computed under the other's prefix.
    """

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        hashes: list[BlockHash] = []
        root = none_hash(self.hash_fn, self.seed)
        tokens = request.token_ids
        for i in range(len(tokens) // self.block_size):
            start, end = i * self.block_size, (i + 1) * self.block_size
            extra = block_extra_keys(start, end, request.lora_name, request.mm_inputs, request.cache_salt)
            hashes.append(hash_block_tokens(root, tokens[start:end], extra, self.hash_fn))  # MUTANT: parent = root
        return tuple(hashes)


class CacheSaltIgnored(ReferenceManagerAdapter):
    """The chain is computed without the request's `cache_salt`: tenants share each other's prefixes."""

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        return hash_request_blocks(
            request.token_ids,
            self.block_size,
            request.lora_name,
            request.mm_inputs,
            None,  # MUTANT: `request.cache_salt`
            self.hash_fn,
            self.seed,
        )


class CacheSaltOnEveryBlock(ReferenceManagerAdapter):
    """`cache_salt` is added to every block's extra keys, not to the first block's only.

    Sharing is unchanged (the chain already carries the salt), but every
    salted block's hash differs from vLLM's: an external KV store keyed by
    vLLM's hashes never matches these blocks.
    """

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        hashes: list[BlockHash] = []
        parent = none_hash(self.hash_fn, self.seed)
        tokens = request.token_ids
        for i in range(len(tokens) // self.block_size):
            start, end = i * self.block_size, (i + 1) * self.block_size
            keys: tuple[ExtraKey, ...] = block_extra_keys(start, end, request.lora_name, request.mm_inputs) or ()
            # MUTANT: the salt's key on every block, not only when start == 0
            keys = (*keys, *(block_extra_keys(0, 0, cache_salt=request.cache_salt) or ()))
            parent = hash_block_tokens(parent, tokens[start:end], keys or None, self.hash_fn)
            hashes.append(parent)
        return tuple(hashes)


class LoraIgnored(ReferenceManagerAdapter):
    """The chain is computed without the LoRA name: a request under one adapter hits another's KV."""

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        return hash_request_blocks(
            request.token_ids,
            self.block_size,
            None,  # MUTANT: `request.lora_name`
            request.mm_inputs,
            request.cache_salt,
            self.hash_fn,
            self.seed,
        )


class MultiModalIgnored(ReferenceManagerAdapter):
    """The chain is computed without the multimodal inputs: two prompts with the same placeholder
    tokens but different images share blocks."""

    def _block_hashes(self, request: Request) -> tuple[BlockHash, ...]:
        return hash_request_blocks(
            request.token_ids,
            self.block_size,
            request.lora_name,
            (),  # MUTANT: `request.mm_inputs`
            request.cache_salt,
            self.hash_fn,
            self.seed,
        )


MUTANTS: list[Mutant] = [
    Mutant(
        name="chain_ignores_parent",
        description=(
            "each block is hashed with NONE_HASH as its parent, so equal blocks under different prefixes share a hash"
        ),
        level="manager",
        factory=ChainIgnoresParent,
        kind="a hash chain that ignores its parent",
    ),
    Mutant(
        name="cache_salt_ignored",
        description="the block hashes leave out cache_salt, so requests of different tenants share blocks",
        level="manager",
        factory=CacheSaltIgnored,
        kind="cache_salt missing or on every block",
    ),
    Mutant(
        name="cache_salt_on_every_block",
        description="cache_salt is an extra key of every block instead of the first block only",
        level="manager",
        factory=CacheSaltOnEveryBlock,
        kind="cache_salt missing or on every block",
    ),
    Mutant(
        name="lora_ignored",
        description="the block hashes leave out the LoRA name, so requests under different adapters share blocks",
        level="manager",
        factory=LoraIgnored,
        kind="LoRA ignored",
    ),
    Mutant(
        name="multimodal_ignored",
        description="the block hashes leave out the multimodal inputs, so prompts with different images share blocks",
        level="manager",
        factory=MultiModalIgnored,
        kind="multimodal inputs ignored",
    ),
]
