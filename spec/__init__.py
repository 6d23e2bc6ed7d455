"""The executable specification of vLLM's prefix-caching block manager.

Pure Python: no I/O, no randomness, no clocks. `state` holds the frozen pool
state and the `Snapshot` type; `invariants` every invariant, once; `ops` the
BlockPool operations with contracts; `manager` the request level
(KVCacheManager); `ordering` the eviction-order rules and profiles; `hashing`
the prefix hash chain; `errors` what a caller's mistake gets.
"""

from kvspec.spec.errors import (
    AlreadyCached,
    BlockManagerError,
    DoubleFree,
    InvalidBlock,
    InvalidRequest,
    InvariantViolation,
    NotWritable,
    PoolExhausted,
)
from kvspec.spec.invariants import HIT_RULES, INVARIANTS, STEP_RULES, all_hold, check_all
from kvspec.spec.ordering import DEFAULT_PROFILE, PROFILES
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash, BlockId, PoolConfig, PoolState, Snapshot

__all__ = [
    "DEFAULT_PROFILE",
    "HIT_RULES",
    "INVARIANTS",
    "NULL_BLOCK_ID",
    "PROFILES",
    "STEP_RULES",
    "AlreadyCached",
    "BlockHash",
    "BlockId",
    "BlockManagerError",
    "DoubleFree",
    "InvalidBlock",
    "InvalidRequest",
    "InvariantViolation",
    "NotWritable",
    "PoolConfig",
    "PoolExhausted",
    "PoolState",
    "Snapshot",
    "all_hold",
    "check_all",
]
