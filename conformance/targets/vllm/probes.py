"""Directed probes: vLLM's historical block-manager bugs and caller mistakes, one short trace each.

A probe is a few pool-level (or request-level) calls that show one known bug
or mistake if a release has it: a double free, the null block freed or
touched, a block registered twice, usage counting the null block, a hash left
behind by eviction, reset while blocks are held; at the request level a
request freed twice, and a block filled in decode right after an image.
`run_probes` drives them through the harness's lock-step and records what the
release does. The oracle runs them on every release; plugin targets run them
too (``kvspec.conformance.targets.plugins.findings``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep
from kvspec.conformance.core.results import Verdict
from kvspec.conformance.core.trace import write_trace
from kvspec.spec.hashing import DEFAULT_HASH_FN, DEFAULT_SEED, MultiModalInput
from kvspec.spec.manager import Request

__all__ = ["PROBES", "REQUEST_PROBES", "V0_PROBES", "Probe", "ProbeResult", "run_probes"]


@dataclass(frozen=True, slots=True)
class Probe:
    """A short pool-level scenario that shows one known bug or caller mistake, if the release has it."""

    name: str  # what the release does when the probe diverges, in a few words
    steps: tuple[tuple[str, tuple[Any, ...]], ...]  # (op, args) in order
    needs: str | None = None  # "null_block": only for releases that have one


def _h(n: int) -> bytes:
    return bytes([0xA0 + n]) * 4


PROBES: tuple[Probe, ...] = (
    Probe(
        "double free accepted silently", (("get_new_blocks", (1,)), ("free_blocks", ([1],)), ("free_blocks", ([1],)))
    ),
    Probe("null block freed", (("free_blocks", ([0],)),), needs="null_block"),
    Probe("null block touched", (("touch", ([0],)),), needs="null_block"),
    Probe(
        "cached block registered again",
        (("get_new_blocks", (1,)), ("cache_full_blocks", ([1], [_h(1)])), ("cache_full_blocks", ([1], [_h(2)]))),
    ),
    Probe("free block registered", (("cache_full_blocks", ([1], [_h(1)])),)),
    Probe("usage counts the null block", (("get_new_blocks", (1,)), ("get_usage", ()))),
    Probe(
        "hash left behind by eviction",
        (
            ("get_new_blocks", (1,)),
            ("cache_full_blocks", ([1], [_h(3)])),
            ("free_blocks", ([1],)),
            ("get_new_blocks", (3,)),
            ("get_cached_block", (_h(3),)),
        ),
    ),  # fmt: skip
    Probe("reset accepted while blocks are held", (("get_new_blocks", (1,)), ("reset_prefix_cache", ()))),
    Probe(
        "reset refused with every block free",
        (("get_new_blocks", (2,)), ("free_blocks", ([2, 1],)), ("reset_prefix_cache", ())),
    ),  # fmt: skip
)


# Request-level probes (block size 4, a pool of 8): a caller mistake, sent here
# as if it were a valid call so the matrix says in one line what the release
# does (campaigns send it as a mistake and check its declared reaction,
# kvspec.conformance.targets.vllm.reactions), and a known bug, each replayed once.
_PROBE_PROMPT = Request("p1", tuple(range(8)))
# An image over block 0 exactly; block 1 fills during decode. Until the overlap
# test became `start >= offset + length` (0.19), a block hashed as it fills
# looked at the last image again and took its key when it starts where the
# image ends, while the prompt's own chain leaves it out: the same prefix then
# misses that block.
_IMAGE = (MultiModalInput("img-a", 0, 4),)
_DECODE = Request("p2", tuple(range(5)), mm_inputs=_IMAGE)
REQUEST_PROBES: tuple[Probe, ...] = (
    Probe(
        "free of a request that is not running accepted silently",
        (
            ("get_computed_blocks", (_PROBE_PROMPT,)),
            ("allocate_slots", (_PROBE_PROMPT, 8, 0, [], 0)),
            ("free", ("p1",)),
            ("free", ("p1",)),
        ),
    ),
    Probe(
        "block filled in decode after an image keyed by that image",
        (
            ("get_computed_blocks", (_DECODE,)),
            ("allocate_slots", (_DECODE, 5, 0, [], 0)),
            ("allocate_slots", (Request("p2", tuple(range(8)), mm_inputs=_IMAGE), 3, 0, [], 0)),
            ("get_computed_blocks", (Request("p3", tuple(range(9)), mm_inputs=_IMAGE),)),
        ),
    ),
)


# v0's allocator (conformance/targets/vllm/v0.py), under lru-timestamp: what it does that the spec does not.
# v0 keeps one block per hash (the spec keeps duplicates: block tables stay append-only),
# and its free list of blocks without content is a stack (appendleft, popleft), not first fit.
V0_PROBES: tuple[Probe, ...] = (
    Probe(
        "full block of a cached hash swapped for the cached block",
        (("get_new_blocks", (2,)), ("cache_full_blocks", ([1, 2], [_h(1), _h(1)]))),
    ),
    Probe(
        "block without content reused last freed first not lowest id first",
        (("get_new_blocks", (2,)), ("free_blocks", ([1, 2],)), ("get_new_blocks", (1,))),
    ),
    Probe(
        "cached blocks not evicted oldest last access first",
        (
            ("get_new_blocks", (3,)),
            ("cache_full_blocks", ([1, 2, 3], [_h(1), _h(2), _h(3)])),
            ("free_blocks", ([3, 1, 2],)),
            ("touch", ([1],)),
            ("free_blocks", ([1],)),
            ("get_new_blocks", (1,)),
        ),
    ),
)


@dataclass(slots=True)
class ProbeResult:
    """What one probe found on one release."""

    name: str  # Probe.name
    verdict: str  # "conforms" (the bug is absent) or what the harness called the failure
    step: int | None = None  # the step that shows it
    op: str | None = None  # its operation
    message: str = ""  # the harness's explanation
    trace_path: str | None = None  # a trace `kvspec replay` replays to the same verdict


def run_probes(
    factory: Callable[[AdapterConfig], Any],
    profile: str,
    trace_dir: str | None,
    impl_name: str,
    num_gpu_blocks: int = 4,
    *,
    level: str = "pool",
    probes: Sequence[Probe] | None = None,
) -> list[ProbeResult]:
    """Run every probe of a level against ``factory`` through the harness's lock-step (each is minimal: no shrinking).

    Args:
        factory: The adapter factory.
        profile: The spec profile to check against (one the release conforms to, where there is one).
        trace_dir: Where the traces of probes that diverge go (None: not written).
        impl_name: The implementation's name, written into traces.
        num_gpu_blocks: The pool size (the request level uses 8: its probe needs two blocks).
        level: ``"pool"`` (``PROBES``) or ``"manager"`` (``REQUEST_PROBES``).
        probes: Instead of the level's, these (``V0_PROBES`` for v0's allocator).

    Returns:
        One result per probe that the adapter can run.
    """

    results: list[ProbeResult] = []
    if probes is None:
        probes = PROBES if level == "pool" else REQUEST_PROBES
    # The hash function and seed the factory names (a release's own where its chain is kvspec's), as a campaign.
    hash_fn, seed = getattr(factory, "spec_hashing", lambda: (DEFAULT_HASH_FN, DEFAULT_SEED))()
    config = AdapterConfig(level="pool" if level == "pool" else "manager", num_gpu_blocks=num_gpu_blocks,
                           enable_caching=True, profile=profile, hash_fn=hash_fn, seed=seed)  # fmt: skip
    for probe in probes:
        lock = LockStep(factory, config)
        if any(not callable(getattr(lock.adapter, op, None)) for op, _ in probe.steps):
            continue  # an operation this release lacks
        if probe.needs == "null_block" and not getattr(lock.adapter, "has_null_block", True):
            continue  # 0.8.0 to 0.8.2: there is no null block to misuse
        result = ProbeResult(probe.name, Verdict.CONFORMS.value)
        try:
            lock.check()
            for op, args in probe.steps:
                lock.call(op, *[list(a) if isinstance(a, list) else a for a in args])
                lock.check()
        except ConformanceFailure as failure:
            f = failure.failure
            result = ProbeResult(probe.name, f.kind.value, f.step, f.op, f.message)
            if trace_dir is not None:
                slug = probe.name.replace(" ", "-")
                path = Path(trace_dir) / f"{impl_name.replace('@', '-')}-probe-{slug}.trace.jsonl"
                try:
                    result.trace_path = str(write_trace(path, lock.trace(impl_name)))
                except OSError as e:  # the finding stands; its trace is missing
                    result.message += f" (trace not saved in {trace_dir}: {e.strerror or e})"
        results.append(result)
    return results
