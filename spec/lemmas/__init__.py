"""The lemmas of docs/design.md, proved with z3: every claim, in one place.

Each lemma lives in its own module, as a list of obligations z3 must prove
(the negation of each is unsat) and a deliberately false twin z3 must refute
with a counterexample, so that a proof that cannot fail is never mistaken for
one that holds. A lemma names the profiles it holds for; under any other
profile it must be refuted, and `kvspec prove` reports that the profile
breaks it. Proofs are for every pool size, queue length and batch size
(quantified over z3 arrays); where one is only checked up to a size the
report says "bounded (n <= N)", never "proved".

1. lemma_tail_first_free_evicts_deeper_first (the queue policies,
   lru-timestamp and lru-lfu:0; block-age, lfu and lru-lfu:W>0 break it): a
   request freed tail-first leaves its hashed blocks so that a deeper block is
   evicted before any of its ancestors.
2. lemma_hashed_free_is_lru (every queue profile): a block freed with a hash is
   evicted after every block free when it was freed, unless one is touched in
   between; no operation reorders free blocks, and get_new_blocks takes from
   the left.
3. lemma_unhashed_free_evicted_first (queue profiles sending unhashed blocks left:
   vllm-v1; vllm-v1-tail breaks it): a block freed without a hash is evicted
   before every block free when it was freed.
4. lemma_touched_free_becomes_mru (as lemma 1): a touched block freed again
   goes behind every block free at that moment.
5. lemma_hit_cap_within_prompt (every profile): for all L >= 1, B >= 1,
   c >= 0: B * min(c, (L - 1) // B) <= L - 1.
6. lemma_key_encoding_matches_queue (every profile): the key encoding
   (lo - k + i left, hi + 1 + i right, take the n smallest) orders blocks as
   the free queue does, after any operation sequence; under a keyed policy,
   gpu_impl's order (first fit by id, then eviction_key) is the spec's.
7. lemma_invariants_inductive (every profile; a keyed one's operations are
   taken with the free blocks in any order): ref_cnt >= 0, null-block,
   free-has-zero-ref, conservation, hash-table-consistent,
   caching-off-no-hash and the writable rule hold initially and after every
   operation.
8. lemma_fewer_accesses_evicted_first (lfu; every other keyed policy breaks
   it): of two free cached blocks, the one with fewer accesses is evicted
   first.
9. lemma_sliding_window_frees_only_unread (every profile): for all c >= 0,
   W >= 2, B >= 1, L >= 1, a sliding:W group skips q = max(0, c - W + 1) // B
   blocks and the first position read, max(0, c - W + 1), lies in block q;
   q never decreases as c grows, so a freed block is never read again; a hit
   of n <= (L - 1) // B blocks whose last cdiv(W - 1, B) are real holds
   every token its first computed token reads.
10. lemma_evict_first_free_evicted_before_cached (every profile): a block
   freed with evict_first (vLLM 0.34.0 on) is evicted before every cached
   block freed without it.

Lemmas 1, 3 and 7 hold whatever a free's evict_first (their frees take it as
an unknown); lemmas 2 and 4 speak of a free without it, which sends a cached
block behind the free ones, and lemma 8 of two blocks freed alike.

Lemmas 2 and 3 speak of the queue's ends and positions, which a keyed
policy (seed 002) does not have: they apply to the queue profiles only, and
lemma 8 speaks of access counts, which only keyed policies keep. A keyed
policy's lemmas read the spec's `keyed_rank` on z3 terms (spec.lemmas.stamps).

This package is the only part of kvspec.spec that imports z3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvspec.spec.lemmas import (
    evict_first,
    fewer_accesses_first,
    hashed_free_lru,
    hit_cap,
    invariants_inductive,
    key_encoding,
    sliding_window,
    tail_first,
    touched_free_mru,
    unhashed_free_first,
)
from kvspec.spec.lemmas.backend import Z3, Universe
from kvspec.spec.lemmas.pool_model import ENCODED_INVARIANTS
from kvspec.spec.lemmas.prover import Obligation, Status, Verdict, decide_false, decide_true
from kvspec.spec.ordering import ProfileRule

__all__ = [
    "ENCODED_INVARIANTS",
    "LEMMAS",
    "Z3",
    "Lemma",
    "Obligation",
    "Status",
    "Universe",
    "Verdict",
    "decide_false",
    "decide_true",
    "lemma_by_name",
]


def _every_profile(rule: ProfileRule) -> bool:
    return True


def _queue_policies(rule: ProfileRule) -> bool:
    return not rule.keyed


def _keyed_policies(rule: ProfileRule) -> bool:
    return rule.keyed


def _recency_orders(rule: ProfileRule) -> bool:
    """The queue policies, and the keyed ones whose key is the last access alone."""
    return not rule.keyed or rule.key == "last-access" or (rule.key == "recency-frequency" and rule.weight == 0)


RECENCY_TEXT = "the queue profiles, lru-timestamp and lru-lfu:0"


@dataclass(frozen=True)
class Lemma:
    """One lemma of docs/design.md: what it claims, where it holds, and how z3 checks it."""

    number: int  # its number in docs/design.md's list
    name: str  # lemma_<subject>_<property>
    claim: str  # the claim in plain words
    holds_for: Callable[[ProfileRule], bool]  # which profiles it holds for
    holds_for_text: str  # the same, in words
    profile_sensitive: bool  # False: the claim does not mention the ordering rule
    obligations: Callable[[ProfileRule], Sequence[Obligation]]  # what z3 must prove
    twin: str  # the deliberately false twin, in plain words
    twin_obligations: Callable[[ProfileRule], Sequence[Obligation]]  # what z3 must refute
    invariants: tuple[str, ...] = ()  # invariants it proves inductive (spec.invariants names / design ids)
    cites: tuple[str, ...] = ()  # lemmas whose obligations it relies on
    twin_profile_sensitive: bool = True  # False: the twin is one fixed claim, checked once
    applies_to: Callable[[ProfileRule], bool] = _every_profile  # the profiles its claim speaks of
    applies_to_text: str = "every profile"  # the same, in words


LEMMAS: tuple[Lemma, ...] = (
    Lemma(
        number=1,
        name=tail_first.NAME,
        claim="a request freed tail-first leaves its hashed blocks so that a deeper block is evicted "
        "before any of its ancestors",
        holds_for=_recency_orders,
        holds_for_text=RECENCY_TEXT,
        profile_sensitive=True,
        obligations=tail_first.obligations,
        twin="the same for a block table freed head-first",
        twin_obligations=tail_first.twin_obligations,
        cites=(hashed_free_lru.NAME,),
    ),
    Lemma(
        number=2,
        name=hashed_free_lru.NAME,
        claim="a block freed with a hash is evicted after every block that was free when it was freed, "
        "unless one of them is touched in between (LRU)",
        holds_for=_every_profile,
        holds_for_text="every profile",
        profile_sensitive=True,
        obligations=hashed_free_lru.obligations,
        twin="the same even if the earlier block is touched and freed again",
        twin_obligations=hashed_free_lru.twin_obligations,
        applies_to=_queue_policies,
        applies_to_text="queue profiles (it speaks of queue positions)",
    ),
    Lemma(
        number=3,
        name=unhashed_free_first.NAME,
        claim="a block freed without a hash is evicted before every block that was free when it was freed",
        holds_for=unhashed_free_first.holds_for,
        holds_for_text="profiles that send unhashed blocks to the left end (vllm-v1)",
        profile_sensitive=True,
        obligations=unhashed_free_first.obligations,
        twin=f"the same under {unhashed_free_first.TWIN_PROFILE}, which sends every freed block right",
        twin_obligations=unhashed_free_first.twin_obligations,
        cites=(hashed_free_lru.NAME,),
        twin_profile_sensitive=False,
        applies_to=_queue_policies,
        applies_to_text="queue profiles (it speaks of queue ends)",
    ),
    Lemma(
        number=4,
        name=touched_free_mru.NAME,
        claim="a touched block that is freed again becomes the most recently used",
        holds_for=_recency_orders,
        holds_for_text=RECENCY_TEXT,
        profile_sensitive=True,
        obligations=touched_free_mru.obligations,
        twin="a touched block freed again keeps its old place in the queue",
        twin_obligations=touched_free_mru.twin_obligations,
        cites=(hashed_free_lru.NAME,),
    ),
    Lemma(
        number=5,
        name=hit_cap.NAME,
        claim="for every prompt length L >= 1, block size B >= 1 and cached chain length c >= 0, "
        "reused tokens B * min(c, (L - 1) // B) <= L - 1",
        holds_for=_every_profile,
        holds_for_text="every profile",
        profile_sensitive=False,
        obligations=lambda rule: hit_cap.obligations(),
        twin="the off-by-one cap B * min(c, L // B) <= L - 1",
        twin_obligations=lambda rule: hit_cap.twin_obligations(),
        invariants=("hit-cap",),
        twin_profile_sensitive=False,
    ),
    Lemma(
        number=6,
        name=key_encoding.NAME,
        claim="the key encoding (left batches keyed lo - k + i, right ones hi + 1 + i, take the n smallest "
        "keys) gives the free queue's order after every operation sequence; under a keyed policy gpu_impl's "
        "order (first fit by id, then eviction_key) is the spec's",
        holds_for=_every_profile,
        holds_for_text="every profile",
        profile_sensitive=True,
        obligations=key_encoding.obligations,
        twin="batches keyed one off at either end (lo - k + 1 + i, hi + i); keyed: first fit by descending id",
        twin_obligations=key_encoding.twin_obligations,
    ),
    Lemma(
        number=7,
        name=invariants_inductive.NAME,
        claim="the pool's state invariants (ref_cnt >= 0, null block, free queue, conservation, hash table, "
        "caching off, the writable rule) hold in a fresh pool and every pool operation preserves them, for any "
        "pool size and any arguments",
        holds_for=_every_profile,
        holds_for_text="every profile",
        profile_sensitive=True,
        obligations=invariants_inductive.obligations,
        twin="free_blocks without the ref_cnt (double-free) check preserves them",
        twin_obligations=invariants_inductive.twin_obligations,
        invariants=tuple(ENCODED_INVARIANTS),
    ),
    Lemma(
        number=8,
        name=fewer_accesses_first.NAME,
        claim="of two free cached blocks, the one with fewer accesses (its allocation and hits) is evicted first",
        holds_for=fewer_accesses_first.holds_for,
        holds_for_text="lfu",
        profile_sensitive=True,
        obligations=fewer_accesses_first.obligations,
        twin="the same for at most as many accesses",
        twin_obligations=fewer_accesses_first.twin_obligations,
        applies_to=_keyed_policies,
        applies_to_text="keyed profiles (queue profiles keep no access counts)",
    ),
    Lemma(
        number=9,
        name=sliding_window.NAME,
        claim="for every computed count c >= 0, window W >= 2, block size B >= 1 and prompt length L >= 1, "
        "a sliding-window group frees only blocks before the window (q * B <= max(0, c - W + 1) for "
        "q = max(0, c - W + 1) // B, and for every later c' too), and a hit of n <= (L - 1) // B blocks "
        "whose last cdiv(W - 1, B) are real holds every token its first computed token reads",
        holds_for=_every_profile,
        holds_for_text="every profile",
        profile_sensitive=False,
        obligations=lambda rule: sliding_window.obligations(),
        twin="a hit needing only (W - 1) // B real blocks holds the first computed token's window",
        twin_obligations=lambda rule: sliding_window.twin_obligations(),
        cites=(hit_cap.NAME,),
        twin_profile_sensitive=False,
    ),
    Lemma(
        number=10,
        name=evict_first.NAME,
        claim="a block freed with evict_first (vLLM 0.34.0 on) is evicted before every cached block freed without it",
        holds_for=_every_profile,
        holds_for_text="every profile",
        profile_sensitive=True,
        obligations=evict_first.obligations,
        twin="the same for a free that ignores evict_first",
        twin_obligations=evict_first.twin_obligations,
        cites=(hashed_free_lru.NAME,),
    ),
)


def lemma_by_name(name: str) -> Lemma:
    """The lemma called `name`.

    Raises:
        KeyError: no lemma has that name.
    """
    for lemma in LEMMAS:
        if lemma.name == name:
            return lemma
    raise KeyError(f"no lemma named {name!r}; known: {', '.join(lem.name for lem in LEMMAS)}")
