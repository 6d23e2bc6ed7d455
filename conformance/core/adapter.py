"""How the harness reaches an implementation: two small protocols and a factory.

An adapter speaks vLLM's operation names and reports its state as the spec's
`Snapshot`. It translates, nothing more: the implementation does the work,
and never knows it is being tested. Operations an implementation lacks (an
old vLLM has no `evict_blocks`) are simply absent from the adapter, and the
harness does not exercise them: `capabilities()` says what is there.

Two levels:
- `BlockManagerAdapter`: one BlockPool (vllm/v1/core/block_pool.py);
- `KVCacheManagerAdapter`: request block tables over a pool (kv_cache_manager.py).

A user names a factory as `module:function`; it is called with one
`AdapterConfig` and returns the adapter for `config.level`.

Which error each caller mistake gets, and in which order an operation checks
its arguments, is the spec's error contract: `kvspec errors` prints it
(kvspec.conformance.core.error_contract computes it from the spec), with the
mistake names the declarations below use.

Optional declarations, as class attributes the harness reads (absent means
the default):
- `validates_bad_input: bool` (default True): the adapter raises the spec's
  error type for every caller mistake it declares no other reaction for.
  An implementation that trusts its caller sets it False (the quick start):
  then only the mistakes it declares a reaction for are sent, and the
  summary names the ones it left out.
- `mistake_reactions: Mapping[str, Reaction]` (default empty): what the
  implementation does with a caller mistake ("<op>: <mistake>", as `kvspec
  errors` names it) instead of raising the spec's error: raises its own
  type, ignores it, accepts it, or cannot express it
  (kvspec.conformance.core.reactions). Every declared mistake is sent and the
  declared reaction checked. `rejected_mistakes` (a set of mistake names)
  is the short form of declaring the spec's error for a few of them.
- An adapter translates and never checks arguments on the implementation's
  behalf; a value the implementation's API cannot take at all (an id that
  names no block, for an API of block objects) it refuses by raising
  `NotExpressible`, and nothing is called.
- `not_applicable: Mapping[str, str]` (default empty): what the harness
  checks that the implementation does not have, each with why (e.g.
  "cache_salt": its requests carry no salt). The machine does not exercise
  it (for "cache_salt": it sends no salted request; for "multimodal inputs":
  no request with images, and no misplaced images as a mistake; for
  "prefix cache hit limit", `operations.HIT_LIMIT`: no request with a
  `prefix_cache_hit_limit`, vLLM 0.34's, and no bad one as a mistake) and
  the summary lists it.
- `levels: tuple[str, ...]` (on the factory or the adapter; default: what
  the built adapter has): the levels the implementation provides. A level it
  does not provide is reported "n/a", never "could not run"; a factory may
  also raise `LevelNotProvided` for it. A factory that builds a pool adapter
  whatever level it is asked for is taken to provide the pool level only.
- `profiles: tuple[str, ...]` (on the factory; default: every profile): the
  eviction policies the implementation provides (`lru-lfu` stands for every
  `lru-lfu:W`). A campaign under another profile is reported "n/a", never run.
- `uses_kvspec_hash_chain: bool` (default False): the adapter hashes blocks
  with kvspec's own chain (kvspec.spec.hashing) for the config's hash_fn and
  seed, so the machine compares block hash values exactly. Otherwise hash
  values are compared as names (an equality relation), and the values are
  checked separately against golden vectors (`kvspec hashes`).
- `spec_hashing: Callable[[], tuple[str, str]]` (on the factory; default
  kvspec's hash function and seed): the hash_fn and seed the machine builds
  every config with, so the spec hashes as the implementation does by
  default (a vLLM release's own, where its chain is kvspec's).
- `kv_cache_groups: bool` (on the adapter; default False): the manager
  builds the KV cache groups `config.groups` names (spec.attention: "full",
  "full,sliding:8", ...; hits and new blocks then cross the API group by
  group, the null block at skipped positions). Without it an adapter is
  checked with one full-attention group only, and a campaign with another
  layout is "n/a"; a factory may raise `LevelNotProvided` for a layout it
  cannot build.
- `take_events() -> list[KVCacheEvent]` (with `config.events`): the KV cache
  events the implementation published since the last call, as the spec's
  types (kvspec.spec.events), keys as its hash table holds them; drained
  after every call and compared with the spec's, and the router's mirror
  rules (`EVENT_RULES`) checked on them. Absent: the campaign checks the
  state and says "not provided: take_events".
- `prefix_cache_stats() -> PrefixCacheStats` (request level, with
  `config.events`): the hit counters since the manager was built
  (kvspec.spec.stats), compared after every step. Counters its
  implementation does not keep are declared `not_applicable["connector
  statistics"]` (the external connector's) or `not_applicable["reset
  count"]`; BlockStored fields it does not publish, `not_applicable[
  "BlockStored.<field>"]` (kvspec.conformance.core.kv_events.EVENT_FIELDS).
- `get_computed_blocks(request, max_cache_hit_length=None)`: an adapter
  whose method takes the cap (the scheduler's, from an external connector)
  gets caps drawn; one written before it is called with the request alone.
- the `KVContentAdapter` methods: the machine has the adapter write, for
  every computed token, a value that names the token's whole prefix, and
  reads every prefix hit back (invariant hit_content_intact).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from kvspec.conformance.core.kv_events import EVENT_FIELDS
from kvspec.conformance.core.operations import HIT_LIMIT, optional_operations
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED
from kvspec.spec.manager import Request
from kvspec.spec.state import BlockHash, BlockId, Snapshot

__all__ = [
    "OPTIONAL_POOL_OPS",
    "AdapterConfig",
    "AdapterFactory",
    "BlockManagerAdapter",
    "HarnessLimit",
    "KVCacheManagerAdapter",
    "KVContentAdapter",
    "KVSource",
    "LevelNotProvided",
    "LEFT_OUT_BY_DECLARATION",
    "capabilities",
    "misdeclared",
    "provides_profile",
]

Level = Literal["pool", "manager"]

# Pool operations an adapter may lack (the operations table marks them); the
# machine skips a rule whose op is missing.
OPTIONAL_POOL_OPS: tuple[str, ...] = optional_operations("pool")

# The `not_applicable` keys the harness reads: each leaves a feature out of what is drawn or compared
# (and "BlockStored.<field>" for each of kv_events.EVENT_FIELDS). Any other key is the adapter's own note
# on what it arranges itself: printed in the summary, read by nothing.
NO_CACHE_SALT = "cache_salt"  # requests are sent without a cache salt
NO_IMAGES = "multimodal inputs"  # requests are sent without multimodal inputs
NO_CONNECTOR_STATS = "connector statistics"  # the hit statistics' connector counters are not compared
NO_RESET_COUNT = "reset count"  # the hit statistics' reset count is not compared
LEFT_OUT_BY_DECLARATION = (NO_CACHE_SALT, NO_IMAGES, HIT_LIMIT.name, NO_CONNECTOR_STATS, NO_RESET_COUNT)


class LevelNotProvided(ValueError):
    """Raised by a factory asked for a level its implementation does not have (the harness reports it n/a)."""


class HarnessLimit(Exception):
    """Raised inside an implementation's call where kvspec, not the implementation, cannot go on.

    Light mode's stand-in for a device runtime raises it when pool code calls
    one (kvspec.conformance.targets.loader.DeviceRuntimeModule): kvspec cannot
    say what the real call would have done, so the check ends without a verdict
    on the implementation (could-not-run, exit 2) instead of calling it a crash.
    """


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What the harness asks a factory to build."""

    level: Level  # "pool" or "manager"
    num_gpu_blocks: int  # the null block included
    enable_caching: bool = True  # prefix caching on or off
    profile: str = "vllm-v1"  # the ordering rule the harness checks against
    block_size: int = 4  # tokens per block (manager level)
    hash_fn: str = DEFAULT_HASH_FN  # the spec's hash function (manager level)
    seed: str = DEFAULT_SEED  # NONE_HASH seed (manager level)
    device: str | None = None  # for device-backed implementations: "cpu", "cuda:0", None = pick
    # The KV cache groups (manager level; spec.attention): "full", "full,sliding:8", ...
    groups: str = "full"
    # Check what the pool tells the world: its KV cache events (take_events) and, at the
    # manager level, its prefix-cache hit statistics (prefix_cache_stats). An adapter
    # builds its implementation with both on (vLLM: enable_kv_cache_events, log_stats).
    events: bool = False


@runtime_checkable
class BlockManagerAdapter(Protocol):
    """One BlockPool, driven by the harness with vLLM's operation names.

    Every method raises the spec's error type for a caller mistake
    (kvspec.spec.errors), checking in the spec's order, and then leaves the
    state as it was; `kvspec errors` lists each mistake, its type and the order.

    The optional operations (`OPTIONAL_POOL_OPS`: `reset_prefix_cache`,
    `evict_blocks`, `is_block_writable`, `get_num_free_blocks`, `get_usage`)
    take vLLM's names and the spec's arguments where an adapter has them;
    `reset_prefix_cache()` forgets every hash if no block is held and returns
    False otherwise (vLLM v0 before 0.7.0 has none).
    """

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        """Take blocks from the left end of the free queue (evicting their hashes)."""
        ...

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """Take a cache hit on blocks: out of the free queue, ref_cnt + 1."""
        ...

    def get_cached_block(self, block_hash: BlockHash) -> BlockId | None:
        """The first block registered under a hash, or None."""
        ...

    def cache_full_blocks(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash]) -> None:
        """Register full, held blocks under the given hashes."""
        ...

    def free_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one reference per block, in eviction-priority order."""
        ...

    def snapshot(self) -> Snapshot:
        """The state in the spec's normal form (block_tables None)."""
        ...


@runtime_checkable
class KVCacheManagerAdapter(Protocol):
    """A KVCacheManager over one pool: the request level.

    As at the pool level, a caller mistake raises the spec's error type and
    changes nothing; `kvspec errors` lists them.
    """

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        """A new request's cached prefix and the tokens it covers (an adapter may take
        `max_cache_hit_length=None` after the request: the module doc)."""
        ...

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[BlockId] = (),
        num_external_computed_tokens: int = 0,
    ) -> list[BlockId] | None:
        """Slots for a step's tokens; None and no change when blocks run out."""
        ...

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request, tail first."""
        ...

    def snapshot(self) -> Snapshot:
        """The pool's state with every running request's block table."""
        ...


# The "model": the value of the KV computed for token positions [start, end) of a
# request. The harness derives it from the whole prefix (tokens and extra keys),
# so two different prefixes never produce the same value.
KVSource = Callable[[Request, int, int], Sequence[int]]


@runtime_checkable
class KVContentAdapter(Protocol):
    """A manager whose blocks hold real KV memory (gpu_impl): the harness checks the content.

    The adapter writes, inside `allocate_slots`, the values `source` gives for
    every token the step computes (before those blocks are registered), and
    refuses (`NotWritable`) a write into a block that is not writable.
    """

    def set_kv_source(self, source: KVSource) -> None:
        """Where the values written for computed tokens come from."""
        ...

    def read_kv(self, block_ids: Sequence[BlockId]) -> list[list[int]]:
        """The value in every slot of each block, read back from the KV memory."""
        ...


class AdapterFactory(Protocol):
    """Builds an adapter for a configuration.

    A factory that cannot build a level raises `LevelNotProvided` naming what it supports.
    """

    def __call__(self, config: AdapterConfig) -> BlockManagerAdapter | KVCacheManagerAdapter:
        """The adapter for `config.level`."""
        ...


def provides_profile(declared: Sequence[str], profile: str) -> bool:
    """Whether a factory declaring `profiles=declared` provides `profile` (`lru-lfu` covers every weight).

    >>> provides_profile(("vllm-v1", "lru-lfu"), "lru-lfu:0.5"), provides_profile(("vllm-v1",), "lfu")
    (True, False)
    """
    return profile in declared or (profile.startswith("lru-lfu:") and "lru-lfu" in declared)


def misdeclared(known_deviations: Sequence[str], not_applicable: Sequence[str]) -> str | None:
    """What is wrong with an adapter's declarations of what it leaves out, or None: a name the harness
    would not act on while the summary said it did.

    A known deviation must name an optional operation (of either level): any other is called and compared
    all the same. A `not_applicable` key spelt like one the harness reads, but not exactly (`cache salt`,
    `multimodal input`), or naming a BlockStored field there is not, would leave its feature drawn.

    >>> misdeclared(["get_usage"], ["cache_salt", "exact hash values"]) is None
    True
    >>> misdeclared([], ["Cache salt"])
    "not_applicable names 'Cache salt'; the harness reads 'cache_salt'"
    """
    comparable = set(optional_operations("pool") + optional_operations("manager"))
    for op in known_deviations:
        if op not in comparable:
            return (
                f"known_deviations names {op!r}, not an operation the harness can leave uncalled "
                f"(those it can: {', '.join(sorted(comparable))})"
            )
    spelt = {_spelling(key): key for key in LEFT_OUT_BY_DECLARATION}
    for key in not_applicable:
        field = key.removeprefix("BlockStored.")
        if field != key and field not in EVENT_FIELDS:
            return f"not_applicable names {key!r}; BlockStored's fields are {', '.join(EVENT_FIELDS)}"
        meant = spelt.get(_spelling(key))
        if meant is not None and key != meant:
            return f"not_applicable names {key!r}; the harness reads {meant!r}"
    return None


def _spelling(key: str) -> str:
    """A name with case, spaces, underscores, hyphens and a plural's s left out: how a slip is recognised."""
    letters = "".join(c for c in key.lower() if c.isalnum())
    return letters.removesuffix("s")


def capabilities(adapter: object) -> frozenset[str]:
    """The optional operations `adapter` has (the operations table marks which are optional)."""
    optional = optional_operations("pool") + optional_operations("manager")
    return frozenset(op for op in optional if callable(getattr(adapter, op, None)))
