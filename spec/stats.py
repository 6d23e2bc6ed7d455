"""Prefix-cache hit statistics, as vLLM's scheduler records them (`vllm/v1/metrics/stats.py`).

Every operator reads the prefix-cache hit rate: hits / queries, in tokens.
The counters are outputs of the request level (`spec.manager`), checked
after every step like the state. What they count, as vLLM 0.33 and 0.34 do:

- a request is counted when it is admitted (its first `allocate_slots`
  returns blocks), not when it is looked up: a lookup whose allocation is
  refused, and which the scheduler retries next step, is counted once;
- only a request whose lookup ran is counted in the local counters: with
  caching off, or for a request that may not read the cache (a hit limit of
  0, `spec.manager.lookup_enabled`), there was no query of this cache, and
  vLLM's `record_prefix_cache_stats` returns ("Don't count a request that
  skipped the cache lookup"), so a hit rate stays undefined rather than 0;
- queries are the request's tokens at admission, local hits the tokens its
  prefix hit covers (`num_new_computed_tokens`);
- a request admitted again after a preemption (`Request.num_preemptions > 0`)
  is counted apart (`preempted_*`), so that recomputing its own blocks is
  not mistaken for a hit rate;
- the external connector's tokens are counted apart from local hits (seed
  000, section 5: local hits first, then the connector's, or the prefix
  cache's gain is credited to the external cache): `connector` counts, per
  admitted request, the tokens the connector was asked for (those after
  the local hit) and the tokens it supplied, whether or not the local
  lookup ran (vLLM's scheduler records them apart from the manager's);
- a successful `reset_prefix_cache` is recorded (`num_resets`).

Design choice: the counters only grow, from the manager's construction on.
vLLM hands out an interval's counters and starts again
(`make_prefix_cache_stats`); an adapter adds its intervals up, so two
implementations that report at different moments still compare equal.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["CacheCounters", "PrefixCacheStats"]


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """Requests, queried tokens and hit tokens of one cache (vLLM's `PrefixCacheStats` fields)."""

    requests: int = 0  # requests admitted for the first time (locally: those whose lookup ran)
    queries: int = 0  # their tokens asked of this cache
    hits: int = 0  # of those, the tokens it supplied
    preempted_requests: int = 0  # requests admitted again after a preemption
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> CacheCounters:
        """The counters with one more admitted request (vLLM's `PrefixCacheStats.record`).

        >>> CacheCounters().record(10, 8, False).record(10, 4, True)
        CacheCounters(requests=1, queries=10, hits=8, preempted_requests=1, preempted_queries=10, preempted_hits=4)
        """
        if preempted:
            return replace(
                self,
                preempted_requests=self.preempted_requests + 1,
                preempted_queries=self.preempted_queries + num_tokens,
                preempted_hits=self.preempted_hits + num_hits,
            )
        return replace(self, requests=self.requests + 1, queries=self.queries + num_tokens, hits=self.hits + num_hits)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens of first admissions (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """The request level's counters since the manager was built: local hits and the connector's, apart."""

    local: CacheCounters = CacheCounters()  # the prefix cache in this pool
    connector: CacheCounters = CacheCounters()  # the external KV connector, asked after the local hit
    num_resets: int = 0  # successful reset_prefix_cache calls

    def admitted(
        self, num_tokens: int, num_local_hits: int, num_external: int, preempted: bool, looked_up: bool
    ) -> PrefixCacheStats:
        """The counters after a request's admission: its local hit (if its lookup ran), then what the connector
        supplied after it.

        >>> s = PrefixCacheStats().admitted(10, 4, 3, False, True)
        >>> (s.local.queries, s.local.hits, s.connector.queries, s.connector.hits)
        (10, 4, 6, 3)
        >>> s = PrefixCacheStats().admitted(10, 0, 3, False, False)
        >>> (s.local.requests, s.connector.requests, s.connector.queries)
        (0, 1, 10)
        """
        return replace(
            self,
            local=self.local.record(num_tokens, num_local_hits, preempted) if looked_up else self.local,
            connector=self.connector.record(num_tokens - num_local_hits, num_external, preempted),
        )
