"""Hash values as names: one pairing of the spec's hashes with an implementation's, for a whole example.

An implementation may compute block hashes its own way (vLLM's chain with
its own seed, a counter), so the harness compares hashes as names: the state
must equal the spec's up to a renaming of hash values, and the renaming must
stay the same from one step to the next (the same prefix keeps its name).
`HashNames` is that renaming. It pairs each spec hash with the
implementation's hash found at the same block, checks that the pairing is
one to one within a step and across steps, and gives each spec hash a short
name (`h1`, `h2`, ... in order of first appearance in the example) that
stories and diffs use, so `h3` at step 2 is `h3` at step 9, also after the
block that held it was evicted.

Design choice: one object for the example, rather than renaming each
snapshot by itself (by first appearance) and keeping a second map across
steps: a per-snapshot name cannot name a hash that is no longer in the
state (an evicted key), and two namings of the same thing drift.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from kvspec.conformance.core.kv_events import events_as
from kvspec.conformance.core.trace import TraceStep
from kvspec.spec.events import BlockStored, KVCacheEvent
from kvspec.spec.state import BlockHash, Snapshot, canonical_hash_to_blocks

__all__ = ["HashNames"]


class HashNames:
    """The spec-to-implementation renaming of hash values for one example, fixed once seen, and their short names."""

    def __init__(self) -> None:
        self._s2i: dict[BlockHash, BlockHash] = {}  # spec hash -> implementation hash
        self._i2s: dict[BlockHash, BlockHash] = {}  # implementation hash -> spec hash
        self._names: dict[bytes, str] = {}  # spec hash -> its short name, by first appearance
        self._others: dict[bytes, str] = {}  # implementation hash paired with no spec hash -> x1, x2, ...

    @classmethod
    def from_trace(cls, steps: Iterable[TraceStep]) -> HashNames:
        """The names an example's steps give, in the order the lock-step core gives them."""
        names = cls()
        for step in steps:
            names.name_values(step.args)
            if step.spec_snapshot is None:
                continue
            for h in step.spec_snapshot.block_hash:
                if h is not None:
                    names.name(h)
            if step.impl_snapshot is not None:
                for hs, hi in zip(step.spec_snapshot.block_hash, step.impl_snapshot.block_hash):
                    if hs is not None and hi is not None and hi not in names._i2s:
                        names._i2s[BlockHash(bytes(hi))] = hs
        return names

    def name(self, spec_hash: bytes) -> str:
        """The short name of a spec hash (given on first sight).

        >>> names = HashNames()
        >>> names.name(b"\x07"), names.name(b"\x03"), names.name(b"\x07")
        ('h1', 'h2', 'h1')
        """
        return self._names.setdefault(bytes(spec_hash), f"h{len(self._names) + 1}")

    def name_values(self, value: object) -> None:
        """Name every hash inside an argument (the hashes a step is called with)."""
        if isinstance(value, bytes):
            self.name(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self.name_values(v)

    def impl_name(self, impl_hash: bytes) -> str:
        """An implementation hash's name: that of the spec hash it is paired with, else x1, x2, ..."""
        hs = self._i2s.get(BlockHash(bytes(impl_hash)))
        if hs is not None:
            return self.name(hs)
        if bytes(impl_hash) in self._names:
            return self._names[bytes(impl_hash)]
        return self._others.setdefault(bytes(impl_hash), f"x{len(self._others) + 1}")

    def given(self) -> tuple[dict[str, str], dict[str, str]]:
        """The names given so far, by hex value: (spec hash -> name, implementation hash -> name)."""
        spec = {h.hex(): n for h, n in self._names.items()}
        impl = {bytes(hi).hex(): self.name(hs) for hi, hs in self._i2s.items()}
        impl.update({h.hex(): n for h, n in self._others.items()})
        return spec, impl

    def local_pairs(self, spec: Snapshot, impl: Snapshot) -> dict[BlockHash, BlockHash] | None:
        """The spec-to-implementation pairs one step's snapshots imply, or None where they are not one to one.

        Block b's spec hash is paired with block b's implementation hash; a
        block hashed on one side only, or two spec hashes for one
        implementation hash (or the reverse), means the states differ.
        """
        s2i: dict[BlockHash, BlockHash] = {}
        i2s: dict[BlockHash, BlockHash] = {}
        for hs, hi in zip(spec.block_hash, impl.block_hash):
            if (hs is None) != (hi is None):
                return None
            if hs is None or hi is None:
                continue
            if s2i.setdefault(hs, hi) != hi or i2s.setdefault(hi, hs) != hs:
                return None
        return s2i

    def conflict(self, spec: Snapshot, pairs: dict[BlockHash, BlockHash]) -> int | None:
        """The first block whose pairing contradicts an earlier step's, or None."""
        for b, hs in enumerate(spec.block_hash):
            if hs is None:
                continue
            hi = pairs[hs]
            if self._s2i.get(hs, hi) != hi or self._i2s.get(hi, hs) != hs:
                return b
        return None

    def learn(self, pairs: dict[BlockHash, BlockHash]) -> None:
        """Fix this step's pairs for the rest of the example (call after `conflict` found none)."""
        for hs, hi in pairs.items():
            self._s2i[hs] = hi
            self._i2s[hi] = hs
            self.name(hs)

    def events_as_spec(
        self, spec_events: Sequence[KVCacheEvent], impl_events: Sequence[KVCacheEvent]
    ) -> tuple[KVCacheEvent, ...]:
        """The implementation's events with each key replaced by the spec key it is paired with.

        Keys come from the state, where the pairing is learnt; a parent that no
        table ever held (a group's null position) is paired here, event by
        event, when both streams name one no pairing has seen. A key paired
        with nothing stays as it is, and so differs from the spec's.
        """
        if len(spec_events) == len(impl_events):
            for es, ei in zip(spec_events, impl_events):
                if isinstance(es, BlockStored) and isinstance(ei, BlockStored):
                    ps, pi = es.parent_block_hash, ei.parent_block_hash
                    if ps is not None and pi is not None and ps not in self._s2i and pi not in self._i2s:
                        self.learn({ps: pi})
        return events_as(impl_events, lambda h: self._i2s.get(h, h))

    def as_spec(self, impl: Snapshot, pairs: dict[BlockHash, BlockHash]) -> Snapshot:
        """The implementation's snapshot with each hash replaced by the spec hash it is paired with."""
        i2s = {hi: hs for hs, hi in pairs.items()}

        def rename(h: BlockHash) -> BlockHash:
            return i2s.get(h, h)

        return replace(
            impl,
            block_hash=tuple(None if h is None else rename(h) for h in impl.block_hash),
            hash_to_blocks=canonical_hash_to_blocks(tuple((rename(h), bl) for h, bl in impl.hash_to_blocks)),
        )

    def named(self, spec: Snapshot, impl: Snapshot) -> tuple[Snapshot, Snapshot]:
        """Both snapshots with hashes as short names, for a diff a person reads.

        Spec hashes get their names; an implementation hash gets the name of
        the spec hash it is (or was) paired with, else the name of the spec
        hash at the same block in this step, else `x1`, `x2`, ...
        """
        for h in spec.block_hash:
            if h is not None:
                self.name(h)
        at_block = {hi: hs for hs, hi in zip(spec.block_hash, impl.block_hash) if hs is not None and hi is not None}

        def spec_name(h: BlockHash) -> BlockHash:
            return BlockHash(self.name(h).encode())

        def impl_name(h: BlockHash) -> BlockHash:
            hs = self._i2s.get(h, at_block.get(h))
            return spec_name(hs) if hs is not None else BlockHash(self.impl_name(h).encode())

        return _renamed(spec, spec_name), _renamed(impl, impl_name)


def _renamed(s: Snapshot, rename: Callable[[BlockHash], BlockHash]) -> Snapshot:
    return replace(
        s,
        block_hash=tuple(None if h is None else rename(h) for h in s.block_hash),
        hash_to_blocks=tuple((rename(h), bl) for h, bl in s.hash_to_blocks),
    )
