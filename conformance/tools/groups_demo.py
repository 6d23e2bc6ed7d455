"""A short request-level walkthrough of KV cache groups, driven through any manager adapter.

`kvspec demo --groups full,sliding:8` plays one story on a manager with those
groups (blocks of four tokens, six blocks per group): request A's prompt is
scheduled whole, A decodes one token per step, and a group that no longer
reads a block (a sliding window moving on, a chunk ending) frees it and puts
the null block in its place; A finishes, and B, which starts with A's
tokens, hits what every group can serve: full attention the whole prefix, a
sliding window only the blocks its first new token reads, the null block
before them. Each state is checked against every invariant and against the
spec's state after the same calls, so the demo is also a check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvspec.conformance.core.adapter import AdapterConfig, KVCacheManagerAdapter
from kvspec.conformance.targets.builtin import make_spec
from kvspec.spec.attention import parse_groups
from kvspec.spec.invariants import failing
from kvspec.spec.manager import Request
from kvspec.spec.state import NULL_BLOCK_ID, Snapshot, table_name

__all__ = ["GroupDemoStep", "render_groups_step", "run_groups_demo"]

BLOCK_SIZE = 4
BLOCKS_PER_GROUP = 6
_PROMPT = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)  # 14 tokens: three full blocks and two tokens
_NUM_DECODE = 7


@dataclass(frozen=True)
class GroupDemoStep:
    """One step of the story: what happened, the state after it, and whether it agrees with the spec's."""

    step: int
    action: str
    snapshot: Snapshot
    result: str  # what the call returned, in words
    broken: tuple[str, ...]  # invariants the state breaks (none, for a correct model)
    agrees: bool  # the state equals the spec's after the same calls


def run_groups_demo(factory: Callable[[AdapterConfig], object], groups: str) -> list[GroupDemoStep]:
    """Play the story on `factory`'s manager with `groups` (and on the spec beside it); one state per step."""
    num_groups = len(parse_groups(groups))
    config = AdapterConfig("manager", 1 + BLOCKS_PER_GROUP * num_groups, block_size=BLOCK_SIZE, groups=groups)
    models = [_manager(factory, config), _manager(make_spec, config)]
    steps: list[GroupDemoStep] = []

    def record(action: str, results: list[object]) -> None:
        snap, spec_snap = (m.snapshot() for m in models)
        shown = results[0] if isinstance(results[0], str) else _blocks(results[0])
        steps.append(GroupDemoStep(len(steps), action, snap, shown, tuple(failing(snap)), snap == spec_snap))

    record("an empty pool: every block free but the null block (0)", ["-"])
    a = Request("A", _PROMPT)
    record(f"A's {len(_PROMPT)}-token prompt is scheduled whole", [m.allocate_slots(a, len(_PROMPT)) for m in models])
    for k in range(_NUM_DECODE):
        a = Request("A", a.token_ids + (20 + k,))
        action = f"A decodes token {len(a.token_ids)}: blocks its groups no longer read are freed first"
        record(action, [m.allocate_slots(a, 1) for m in models])
    for m in models:
        m.free("A")
    record("A finishes: each group's blocks freed tail first, group by group", ["-"])
    b = Request("B", a.token_ids + (30, 31))
    hits = [m.get_computed_blocks(b) for m in models]
    blocks, num_hit = hits[0]
    record(f"B (A's tokens and 2 more) looks up its hit: {num_hit} tokens every group can serve", [blocks])
    num_new = len(b.token_ids) - num_hit
    record(f"B is scheduled with that hit: {num_new} tokens to compute",
           [m.allocate_slots(b, num_new, n, hit) for m, (hit, n) in zip(models, hits)])  # fmt: skip
    return steps


def _manager(factory: Callable[[AdapterConfig], object], config: AdapterConfig) -> KVCacheManagerAdapter:
    manager = factory(config)
    assert isinstance(manager, KVCacheManagerAdapter), f"{factory} did not build a manager adapter"
    return manager


def _blocks(value: object) -> str:
    if value is None:
        return "None (too few free blocks)"
    blocks = list(value)  # type: ignore[call-overload]
    return "[" + " ".join("null" if b == NULL_BLOCK_ID else str(b) for b in blocks) + "]"


def render_groups_step(step: GroupDemoStep, groups: str) -> str:
    """The state: the pool's blocks, the free queue, the hash table, and each request's table per group."""
    s = step.snapshot
    layout = parse_groups(groups)
    cells = " ".join(f"[{b} ref={s.ref_cnt[b]}]{'#' if s.block_hash[b] is not None else ' '}"
                     for b in range(1, s.num_gpu_blocks))  # fmt: skip
    queue = " ".join(str(b) for b in s.free_queue) or "(empty)"
    tables = dict(s.block_tables or ())
    requests = sorted({name.split("#")[0] for name in tables})
    rows = []
    for rid in requests:
        per_group = [f"{g} {_blocks(tables.get(table_name(rid, i), ()))}" for i, g in enumerate(layout)]
        rows.append(f"{rid}: " + " | ".join(per_group))
    lines = [
        f"step {step.step}: {step.action}",
        f"  returned     {step.result}",
        "  GPU blocks   " + cells,
        f"  free queue   (left is taken first)  {queue}",
        f"  hash table   {len(s.hash_to_blocks)} keys (a block hash and its group), "
        f"{sum(1 for h in s.block_hash if h is not None)} blocks registered (#)",
        "  block tables " + ("\n               ".join(rows) if rows else "(none)"),
        f"  invariants   {'all hold' if not step.broken else 'BROKEN: ' + ', '.join(step.broken)}; "
        f"same state as the spec: {'yes' if step.agrees else 'NO'}",
    ]
    return "\n".join(lines)
