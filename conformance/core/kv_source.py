"""The KV the harness has an implementation with KV memory write: a value that names each token's whole prefix.

Adapters with KV memory (`KVContentAdapter`, gpu_impl) write, for every token
a step computes, the value `PrefixKVSource` gives; every prefix hit is read
back and compared with the values of the request's own prefix (invariant
hit_content_intact), so a hit on blocks whose content is another prefix's is
caught, whatever the block table says.
"""

from __future__ import annotations

from typing import Any

from kvspec.spec.hashing import block_extra_keys
from kvspec.spec.manager import Request

__all__ = ["PrefixKVSource"]


class PrefixKVSource:
    """The harness's model of a layer's KV: token position p's value names the request's prefix up to p.

    A `KVSource` for adapters with KV memory (`KVContentAdapter`). Value p is
    the number the source gave, on first sight, to the pair (value p - 1,
    token p, and at each block's first position the block's extra keys:
    LoRA, multimodal inputs, and the cache_salt on block 0). By induction it
    names the whole prefix (tokens and the extra keys of every block it
    touches), so two different prefixes never get the same value, equal
    prefixes always do, and every value is a small positive int64 (0 is
    never given: a slot nobody wrote reads as no prefix's value). The
    rejected alternative, a digest of the prefix, fits int64 only by
    truncation and then "never" holds only up to collisions.

    One source serves one example: the numbering depends on the order
    prefixes are first seen, so a replay numbers them the same way.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size  # tokens per block: where each block's extra keys join the chain
        self._ids: dict[tuple[Any, ...], int] = {}  # (previous value, token, block keys) -> value

    def __call__(self, request: Request, start: int, end: int) -> list[int]:
        """The values of token positions [start, end) of `request` (its tokens and extra keys). Cost: O(end).

        >>> src = PrefixKVSource(2)
        >>> src(Request("a", (5, 6, 7)), 0, 3), src(Request("b", (5, 6, 8)), 1, 3)
        ([1, 2, 3], [2, 4])
        >>> src(Request("c", (5, 6), cache_salt="t"), 0, 2)
        [5, 6]
        """
        bs, values, previous = self.block_size, [], 0
        for p in range(end):
            keys = (
                block_extra_keys(p, p + bs, request.lora_name, request.mm_inputs, request.cache_salt)
                if p % bs == 0
                else None
            )
            previous = self._ids.setdefault((previous, request.token_ids[p], keys), len(self._ids) + 1)
            if p >= start:
                values.append(previous)
        return values
