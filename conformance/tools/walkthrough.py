"""Seed 000's six-block walkthrough, driven through any pool adapter.

The seed (section 4) plays a pool of six blocks of four tokens through four
requests: A allocates and registers two full blocks, B hits them, both
finish (tail first), then either C hits the freed blocks again or D's fresh
tokens take every block and evict the cached ones. `run_walkthrough` drives
exactly those pool operations and returns the state after each step, in the
golden file's vocabulary (conformance/data/seed_walkthrough.json), so the same
steps check the spec, the reference and any other implementation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from kvspec.conformance.core.adapter import AdapterConfig, BlockManagerAdapter
from kvspec.spec.hashing import hash_request_blocks
from kvspec.spec.state import BlockHash, BlockId, Snapshot

__all__ = ["WalkthroughStep", "load_golden", "render_step", "run_walkthrough"]

BLOCK_SIZE = 4


def load_golden() -> dict[str, Any]:
    """The golden walkthrough (a copy of the seed's states, shipped as this package's data)."""
    text = resources.files("kvspec.conformance").joinpath("data/seed_walkthrough.json").read_text()
    golden: dict[str, Any] = json.loads(text)
    return golden


@dataclass
class WalkthroughStep:
    """One step of the walkthrough: what happened and the state after it."""

    step: int
    action: str
    snapshot: Snapshot
    block_tables: dict[str, list[BlockId]]
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    hash_names: dict[BlockHash, str] = field(default_factory=dict)  # hash value -> "h1", "h2"

    def as_golden(self) -> dict[str, Any]:
        """This state in the golden file's form."""
        s = self.snapshot
        out: dict[str, Any] = {
            "ref_cnt": {str(b): s.ref_cnt[b] for b in range(1, s.num_gpu_blocks)},
            "free_queue": list(s.free_queue),
            "hash_table": {self.hash_names.get(h, h.hex()[:8]): blocks[0] for h, blocks in s.hash_to_blocks},
            "block_tables": self.block_tables,
        }
        if self.num_computed_tokens:
            out["num_computed_tokens"] = self.num_computed_tokens
        return out


def run_walkthrough(factory: Callable[[AdapterConfig], object]) -> list[WalkthroughStep]:
    """Play the seed's walkthrough on a fresh pool from `factory`; one state per golden step."""
    walk = _Walk(factory)
    p, tables = walk.until_step5()
    c_hit = walk.hit(p, "C")
    p.touch(c_hit)
    tables["C"] = list(c_hit)
    walk.record(p, 6, tables, {"C": len(c_hit) * BLOCK_SIZE})
    # Step 7 branches from the state after step 5: replay it on a fresh pool.
    p, tables = walk.until_step5()
    tables["D"] = list(p.get_new_blocks(6))
    walk.record(p, 7, tables, {})
    return walk.steps


class _Walk:
    """The golden walkthrough's requests and chains, and the states recorded so far."""

    def __init__(self, factory: Callable[[AdapterConfig], object]) -> None:
        self.factory = factory
        self.golden = load_golden()
        cfg = self.golden["config"]
        self.config = AdapterConfig("pool", cfg["num_gpu_blocks"], cfg["enable_caching"])
        self.tokens = {name: tuple(t) for name, t in self.golden["requests"].items()}
        self.chain = {name: hash_request_blocks(t, BLOCK_SIZE) for name, t in self.tokens.items()}
        self.names = {h: f"h{i + 1}" for i, h in enumerate(self.chain["A"])}
        self.steps: list[WalkthroughStep] = []

    def pool(self) -> BlockManagerAdapter:
        adapter = self.factory(self.config)
        assert isinstance(adapter, BlockManagerAdapter), f"{self.factory} did not build a pool adapter"
        return adapter

    def record(
        self, p: BlockManagerAdapter, step: int, tables: dict[str, list[BlockId]], computed: dict[str, int]
    ) -> None:
        action = self.golden["steps"][step]["action"]
        tables_now = {k: list(v) for k, v in tables.items()}
        self.steps.append(WalkthroughStep(step, action, p.snapshot(), tables_now, dict(computed), self.names))

    def hit(self, p: BlockManagerAdapter, name: str) -> list[BlockId]:
        max_blocks = (len(self.tokens[name]) - 1) // BLOCK_SIZE  # the len - 1 cap
        blocks: list[BlockId] = []
        for h in self.chain[name][:max_blocks]:
            b = p.get_cached_block(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def until_step5(self) -> tuple[BlockManagerAdapter, dict[str, list[BlockId]]]:
        """Steps 0 to 5 on a fresh pool, each recorded the first time round (step 7 replays them)."""
        p, chain, steps = self.pool(), self.chain, self.steps
        tables: dict[str, list[BlockId]] = {}
        if not steps:
            self.record(p, 0, tables, {})
        tables["A"] = list(p.get_new_blocks(3))
        if len(steps) == 1:
            self.record(p, 1, tables, {})
        p.cache_full_blocks(tables["A"][:2], chain["A"][:2])
        if len(steps) == 2:
            self.record(p, 2, tables, {})
        b_hit = self.hit(p, "B")
        p.touch(b_hit)
        tables["B"] = b_hit + list(p.get_new_blocks(1))
        if len(steps) == 3:
            self.record(p, 3, tables, {"B": len(b_hit) * BLOCK_SIZE})
        p.free_blocks(tables.pop("A")[::-1])
        if len(steps) == 4:
            self.record(p, 4, tables, {})
        p.free_blocks(tables.pop("B")[::-1])
        if len(steps) == 5:
            self.record(p, 5, tables, {})
        return p, tables


def render_step(step: WalkthroughStep, previous: WalkthroughStep | None) -> str:
    """The state as the seed draws it: blocks with ref counts, queue, hash table, block tables.

    Blocks whose ref_cnt, hash or queue membership changed since `previous` are
    marked with `*`; blocks that are registered (hittable) carry a `#`.
    """
    s = step.snapshot
    prev = previous.snapshot if previous else None

    def changed(b: int) -> bool:
        if prev is None:
            return False
        was_free, is_free = b in prev.free_queue, b in s.free_queue
        return s.ref_cnt[b] != prev.ref_cnt[b] or s.block_hash[b] != prev.block_hash[b] or was_free != is_free

    cells = []
    for b in range(1, s.num_gpu_blocks):
        mark = ("*" if changed(b) else " ") + ("#" if s.block_hash[b] is not None else " ")
        cells.append(f"[{b} ref={s.ref_cnt[b]}]{mark}")
    table = "  ".join(f"{step.hash_names.get(h, h.hex()[:8])} -> {list(bl)}" for h, bl in s.hash_to_blocks) or "(empty)"
    tables = "  ".join(f"{r}: {bl}" for r, bl in sorted(step.block_tables.items())) or "(none)"
    queue = " ".join(str(b) for b in s.free_queue) or "(empty)"
    lines = [
        f"step {step.step}: {step.action}",
        "  GPU blocks   " + " ".join(cells),
        f"  free queue   (left is taken first)  {queue}",
        f"  hash table   {table}",
        f"  block tables {tables}",
    ]
    if step.num_computed_tokens:
        lines.append("  computed     " + "  ".join(f"{r}: {n} tokens hit" for r, n in step.num_computed_tokens.items()))
    return "\n".join(lines)
