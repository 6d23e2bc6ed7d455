"""Lemma 4, `lemma_touched_free_becomes_mru`: a touched block that is freed again becomes the
most recently used.

A hit (`touch`) takes a free block out of the queue; when its last holder
frees it, it goes to the right end like any block freed with a hash: behind
every block free at that moment, including the ones that were behind it
before the hit. Its old place is forgotten, which is what makes the queue an
LRU order. The obligation is the two steps, touch then free, from any state
satisfying the invariants. Operations in between change nothing here: the
block is held throughout, so none of them can move it, and the placement
depends only on the free itself (lemma 2). The false twin says the block
keeps its old place: blocks behind it before the hit stay behind it.

Under a keyed policy (seed 002) the hit and the free stamp the block with the
clock, which is past every stamp already given, so under `lru-timestamp` (and
`lru-lfu:0`) it goes behind every block free at the free, as in the queue.
`block-age` reads the registration, which neither changes; `lfu` and
`lru-lfu:W>0` read the access count, and a block free earlier with more
accesses stays behind it: z3 refutes those. The keyed obligations are the
same two steps over `keyed_rank` (spec.lemmas.stamps); their false twin says
the block is evicted before every block free at the free (under `block-age`
"keeps its old place" holds, so it cannot be the twin there).
"""

from __future__ import annotations

from dataclasses import dataclass

import z3

from kvspec.spec.lemmas import pool_model as pm
from kvspec.spec.lemmas import stamps
from kvspec.spec.lemmas.backend import Universe
from kvspec.spec.lemmas.prover import Formula, Obligation
from kvspec.spec.ordering import ProfileRule

__all__ = ["NAME", "obligations", "twin_obligations"]

NAME = "lemma_touched_free_becomes_mru"


@dataclass(frozen=True)
class _TouchThenFree:
    """touch(touched) then free_blocks(freed) from `start`, block b in both and freed by its last holder."""

    touched: pm.Batch
    freed: pm.Batch
    after_touch: pm.PoolVars
    end: pm.PoolVars
    hypotheses: list[z3.BoolRef]  # both calls pass their checks, and b's part in them


def _touch_then_free_steps(u: Universe, rule: ProfileRule, start: pm.PoolVars, b: z3.ArithRef) -> _TouchThenFree:
    touched = pm.fresh_batch(u, "touched")
    hit = pm.touch(u, start, touched)
    freed = pm.fresh_batch(u, "freed")
    release = pm.free_blocks(u, hit.post, freed, rule.unhashed_to_left)
    hypotheses = [
        hit.guard,
        hit.axioms,
        pm.in_batch(touched, b),
        release.guard,
        release.axioms,
        pm.in_batch(freed, b),
        hit.post.ref_cnt[b] == 1,
    ]
    return _TouchThenFree(touched, freed, hit.post, release.post, hypotheses)


def _touch_then_free(rule: ProfileRule, keeps_place: bool) -> Obligation:
    def build(u: Universe) -> Formula:
        s0 = pm.fresh_state(u, "start")
        b, y = z3.Ints("b y")
        steps = _touch_then_free_steps(u, rule, s0, b)
        touched, freed, s1, s2 = steps.touched, steps.freed, steps.after_touch, steps.end
        hypotheses = [pm.all_invariants(u, s0), *steps.hypotheses]
        if keeps_place:
            hypotheses += [
                pm.in_queue(s0, b),
                pm.in_queue(s0, y),
                s0.queue_pos[b] < s0.queue_pos[y],
                pm.in_queue(s2, y),
            ]
            claim = z3.And(pm.in_queue(s2, b), s2.queue_pos[b] < s2.queue_pos[y])
            broken = "is no longer in front of block {y}, which was behind it before the touch"
        else:
            hypotheses.append(pm.in_queue(s1, y))
            claim = z3.And(pm.in_queue(s2, b), pm.in_queue(s2, y), s2.queue_pos[y] < s2.queue_pos[b])
            broken = "is not behind block {y}, which was free when it was freed"
        label = pm.hash_labeller()
        return Formula(
            hypotheses=hypotheses,
            claim=claim,
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s0, "start", label),
                    f"  touch(block_ids={pm.render_batch(m, touched)})",
                    f"  free_blocks(block_ids={pm.render_batch(m, freed)}) [profile {rule.name}]",
                    pm.render_state(m, s2, "end", label),
                    f"  block {pm.model_int(m, b)} " + broken.format(y=pm.model_int(m, y)),
                ]
            ),
        )

    if keeps_place:
        return Obligation("a touched block freed again keeps its old place in the queue", build)
    return Obligation("a touched block freed again is behind every block free at that moment", build)


def _touch_then_free_keyed(rule: ProfileRule, goes_first: bool) -> Obligation:
    def build(u: Universe) -> Formula:
        s0, st0 = pm.fresh_state(u, "start"), stamps.fresh_stamps("start")
        b, y = z3.Ints("b y")
        steps = _touch_then_free_steps(u, rule, s0, b)
        touched, freed, s1, s2 = steps.touched, steps.freed, steps.after_touch, steps.end
        st2 = stamps.after_free(stamps.after_touch(st0, touched), freed)
        hypotheses = [stamps.keyed_state(u, rule, s0, st0), *steps.hypotheses, pm.in_queue(s1, y)]
        if goes_first:
            claim = stamps.before(rule, s2, st2, b, y)
            broken = "is not evicted before block {y}, which was free when it was freed"
        else:
            claim = stamps.before(rule, s2, st2, y, b)
            broken = "is not evicted after block {y}, which was free when it was freed"
        return Formula(
            hypotheses=hypotheses,
            claim=claim,
            render=lambda m: "\n".join(
                [
                    pm.render_state(m, s0, "start", pm.hash_labeller()),
                    stamps.render_stamps(m, st0, {"touched": b, "other": y}, "at the start"),
                    f"  touch(block_ids={pm.render_batch(m, touched)})",
                    f"  free_blocks(block_ids={pm.render_batch(m, freed)}) [profile {rule.name}]",
                    stamps.render_stamps(m, st2, {"touched": b, "other": y}, "at the end"),
                    f"  block {pm.model_int(m, b)} " + broken.format(y=pm.model_int(m, y)),
                ]
            ),
        )

    if goes_first:
        return Obligation("a touched block freed again is evicted before every block free at that moment", build)
    return Obligation("a touched block freed again is evicted after every block free at that moment", build)


def obligations(rule: ProfileRule) -> list[Obligation]:
    """touch then free_blocks, under one profile's rule."""
    if rule.keyed:
        return [_touch_then_free_keyed(rule, goes_first=False)]
    return [_touch_then_free(rule, keeps_place=False)]


def twin_obligations(rule: ProfileRule) -> list[Obligation]:
    """The false twin: the block goes back to where it was before the touch (keyed: it goes first).

    Under a keyed policy "its old place" is no twin: `block-age` keeps it (the
    registration is the key), so the keyed twin is the mirror claim, which
    every keyed policy refutes.
    """
    if rule.keyed:
        return [_touch_then_free_keyed(rule, goes_first=True)]
    return [_touch_then_free(rule, keeps_place=True)]
