"""Hypothesis strategies for workloads that look like real serving.

Bugs in a block manager live where real traffic goes: many requests sharing a
system prompt, multi-turn chats that extend an earlier prompt, pools small
enough that every allocation evicts something, tenants separated by a
cache_salt, LoRA adapters, images in the prompt. Uniformly random token lists
almost never share a full block, so they would leave the whole prefix-cache
path untested. Hence: a vocabulary of a few tokens, a handful of system
prompts per example, chats built on earlier prompts, pools of 1 to 16 blocks
at the pool level and 2 to 24 at the request level.

Every strategy shrinks toward the simplest case (the smallest pool, block
size 1, no LoRA, no salt, no multimodal input), so a shrunk failure names
only what it needs. Strategies that depend on a size are cached per size:
the machine draws them at every step, and building (and validating) a new
strategy object each time cost more than the step itself.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

from hypothesis import strategies as st

from kvspec.spec.attention import FULL, KVGroup, format_groups
from kvspec.spec.hashing import MultiModalInput
from kvspec.spec.manager import Request
from kvspec.spec.state import NULL_BLOCK_ID, BlockHash

__all__ = [
    "MAX_GROUP_SPAN",
    "HASH_UNIVERSE",
    "PLAIN_ID_MISTAKES",
    "LORA_NAMES",
    "CACHE_SALTS",
    "VALID",
    "VOCABULARY_SIZE",
    "bad_block_id_values",
    "bad_block_ids",
    "plain_bad_id_values",
    "plain_bad_ids",
    "bad_counts",
    "bad_hashes",
    "bad_hit_limits",
    "bad_mm_inputs",
    "block_sizes",
    "block_sizes_for",
    "cache_salts",
    "chat_turns",
    "external_tokens",
    "group_layouts",
    "KIND_COMBINATIONS",
    "hash_values",
    "hit_limits",
    "kinds",
    "long_tokens",
    "lora_names",
    "manager_pool_sizes",
    "mm_inputs",
    "one_of",
    "other_keys",
    "pool_sizes",
    "prompts",
    "sampled",
    "system_prompts",
    "token_ids",
]

# A small vocabulary: two prompts written independently still share full blocks
# now and then, which is what exercises duplicate registration.
VOCABULARY_SIZE = 4
LORA_NAMES = ("lora-a", "lora-b")
CACHE_SALTS = ("tenant-1", "tenant-2")
# The block hashes the pool level registers: few, so the same hash is registered
# for several blocks (identical full blocks are not merged) and lookups both hit and miss.
HASH_UNIVERSE: tuple[BlockHash, ...] = tuple(BlockHash(b"hash-%d" % i) for i in range(5))


def pool_sizes() -> st.SearchStrategy[int]:
    """Pool sizes for the pool level (null block included): mostly tiny, so allocation evicts.

    One block (only the null block) is a legal pool; it is drawn now and then,
    not as its own branch (Hypothesis would then often dwell on it).
    """
    return st.one_of(st.integers(2, 6), st.integers(7, 16), st.integers(1, 6))


MAX_MANAGER_POOL = 24  # the most blocks a request-level pool is drawn with, per KV cache group
MAX_BLOCK_SIZE = 16  # the most tokens a block is drawn with
# The widest window or chunk a request-level campaign can cross: its window rule allocates one prompt a
# block past the window, which must fit in one group's share of the largest pool at the largest block size.
# Past it no prompt crosses the window, so its branches could never be reached (and the prompt the rule
# builds grows with the window: a window of 1e20 tokens would not fit in memory).
MAX_GROUP_SPAN = (MAX_MANAGER_POOL - 2) * MAX_BLOCK_SIZE


def manager_pool_sizes() -> st.SearchStrategy[int]:
    """Pool sizes for the request level: a few requests' worth, so admissions fail and evict."""
    return st.one_of(st.integers(2, 10), st.integers(11, MAX_MANAGER_POOL))


def block_sizes() -> st.SearchStrategy[int]:
    """Tokens per block, 1 to 16 (vLLM's default is 16); small sizes first, they shrink best."""
    return st.one_of(st.sampled_from((1, 2, 4)), st.integers(1, MAX_BLOCK_SIZE))


def block_sizes_for(groups: tuple[KVGroup, ...]) -> st.SearchStrategy[int]:
    """Block sizes a layout allows: those that divide every chunk (vLLM asserts it); any, without chunks."""
    chunks = [g.size for g in groups if g.kind == "chunked"]
    if not chunks:
        return block_sizes()
    divisors = [b for b in range(1, 17) if all(c % b == 0 for c in chunks)]
    return st.sampled_from(divisors)


@lru_cache(maxsize=32)
def group_layouts(block_size: int, kinds: frozenset[frozenset[str]] | None = None) -> st.SearchStrategy[str]:
    """One to three KV cache groups: full attention, sliding windows of sizes that are and are not
    multiples of the block size, chunks that are (as vLLM requires); one full-attention group shrinks first.

    `kinds`: the sets of attention types a layout may mix (what the implementation was probed to build,
    `kind_combinations`); None: any.
    """
    b = block_size
    windows = sorted({w for w in (2, b + 1, 2 * b, 2 * b + 1, 3 * b - 1, 4 * b) if w >= 2})
    of_kind = {
        "full": st.just(FULL),
        "sliding": st.sampled_from(windows).map(lambda w: KVGroup("sliding", w)),
        "chunked": st.sampled_from((b, 2 * b, 4 * b)).map(lambda c: KVGroup("chunked", c)),
    }
    if kinds is None:
        group = st.one_of(*of_kind.values())
        return st.lists(group, min_size=1, max_size=3).map(lambda gs: format_groups(tuple(gs)))
    order = tuple(of_kind)
    allowed = sorted(kinds, key=lambda ks: (len(ks), [order.index(k) for k in sorted(ks, key=order.index)]))

    @st.composite
    def layout(draw: st.DrawFn) -> str:
        mixed = sorted(draw(st.sampled_from(allowed)), key=order.index)  # {"full"} first: it shrinks there
        extra = draw(st.lists(st.sampled_from(mixed), max_size=3 - len(mixed)))
        gs = [draw(of_kind[k]) for k in [*mixed, *extra]]
        return format_groups(tuple(draw(st.permutations(gs))))

    return layout()


# One layout of each combination of attention types `group_layouts` mixes (block size 4): what a probe
# builds to learn which combinations an implementation provides.
KIND_COMBINATIONS: dict[frozenset[str], str] = {
    frozenset({"full"}): "full",
    frozenset({"sliding"}): "sliding:8",
    frozenset({"chunked"}): "chunked:8",
    frozenset({"full", "sliding"}): "full,sliding:8",
    frozenset({"full", "chunked"}): "full,chunked:8",
    frozenset({"sliding", "chunked"}): "sliding:8,chunked:8",
    frozenset({"full", "sliding", "chunked"}): "full,sliding:8,chunked:8",
}


def hash_values() -> st.SearchStrategy[BlockHash]:
    """A block hash from the small universe the pool level registers."""
    return st.sampled_from(HASH_UNIVERSE)


@lru_cache(maxsize=1024)
def token_ids(min_size: int, max_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Tokens from the small vocabulary, in one draw: a byte string, each byte a token.

    A list of integers costs a draw per token and one more per element to say
    whether another follows; prompts were most of a campaign's draws. Bytes
    shrink the same way: shorter, then each toward 0 (token 0).
    """
    return st.binary(min_size=min_size, max_size=max_size).map(_as_tokens)


def _as_tokens(raw: bytes) -> tuple[int, ...]:
    return tuple(b % VOCABULARY_SIZE for b in raw)


@lru_cache(maxsize=1024)
def long_tokens(min_size: int, max_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Many tokens from the small vocabulary in two draws: a length and a seed that picks them.

    For tails longer than the pool holds: drawn one by one they cost the
    campaign a draw per token (most of its time, once pools grow with KV cache
    groups), and a shrunk failure never needs their exact values; it shrinks
    to the shortest tail of seed 0.
    """
    return st.tuples(st.integers(min_size, max_size), st.integers(0, 2**32 - 1)).map(
        lambda n_seed: tuple(random.Random(n_seed[1]).choices(range(VOCABULARY_SIZE), k=n_seed[0]))
    )


@lru_cache(maxsize=512)
def system_prompts(block_size: int) -> st.SearchStrategy[tuple[tuple[int, ...], ...]]:
    """One to three shared prefixes (system prompts) for an example's requests, up to two blocks and a bit."""
    return st.lists(token_ids(0, 2 * block_size + 1), min_size=1, max_size=3).map(tuple)


@lru_cache(maxsize=1)
def lora_names() -> st.SearchStrategy[str | None]:
    """No LoRA (shrinks to this), or one of two adapters."""
    return st.one_of(st.none(), st.sampled_from(LORA_NAMES))


@lru_cache(maxsize=1)
def cache_salts() -> st.SearchStrategy[str | None]:
    """No salt (shrinks to this), or one of two tenants."""
    return st.one_of(st.none(), st.sampled_from(CACHE_SALTS))


@st.composite
def _images(draw: st.DrawFn, num_tokens: int, block_size: int, most: int) -> tuple[MultiModalInput, ...]:
    """1 to `most` images inside the prompt, in offset order, none overlapping another.

    That is how vLLM's input processor places them (its block hashing relies
    on it); `bad_mm_inputs` draws the other cases, which are caller mistakes.
    """
    images: list[MultiModalInput] = []
    start = 0  # the first position the next image may take
    for _ in range(draw(st.integers(1, most), label="images")):
        if start >= num_tokens:
            break
        offset = draw(st.integers(start, num_tokens - 1), label="offset")
        length = draw(st.integers(1, min(2 * block_size, num_tokens - offset)), label="length")
        images.append(MultiModalInput(draw(st.sampled_from(("img-a", "img-b")), label="image"), offset, length))
        start = offset + length
    return tuple(images)


@lru_cache(maxsize=1024)
def mm_inputs(num_tokens: int, block_size: int) -> st.SearchStrategy[tuple[MultiModalInput, ...]]:
    """Mostly none; else one or two images placed inside the prompt, possibly spanning blocks."""
    if num_tokens == 0:
        return st.just(())
    return st.one_of(st.just(()), _images(num_tokens, block_size, 2))


def bad_mm_inputs(num_tokens: int) -> st.SearchStrategy[tuple[MultiModalInput, ...]]:
    """Images no input processor would place: past the last token, empty, overlapping, or out of order.

    >>> from hypothesis import find
    >>> find(bad_mm_inputs(6), lambda mm: True)
    (MultiModalInput(identifier='img-a', offset=5, length=2),)
    """
    a, b = "img-a", "img-b"
    return st.sampled_from(
        (
            (MultiModalInput(a, num_tokens - 1, 2),),  # runs past the last token
            (MultiModalInput(a, 0, 0),),  # covers no token
            (MultiModalInput(a, 0, num_tokens), MultiModalInput(b, num_tokens - 1, 1)),  # overlapping
            (MultiModalInput(a, num_tokens - 1, 1), MultiModalInput(b, 0, 1)),  # out of order (or overlapping)
        )
    )


@lru_cache(maxsize=512)
def _prefixes(shared: tuple[tuple[int, ...], ...]) -> st.SearchStrategy[tuple[int, ...]]:
    return st.one_of(st.just(()), st.sampled_from(shared))


@st.composite
def _prompts(draw: st.DrawFn, block_size: int, shared: tuple[tuple[int, ...], ...]) -> Request:
    prefix = draw(_prefixes(shared)) if shared else ()
    user = draw(token_ids(0 if prefix else 1, 2 * block_size + 1))
    tokens = prefix + user
    return Request(
        request_id="",
        token_ids=tokens,
        lora_name=draw(lora_names()),
        cache_salt=draw(cache_salts()),
        mm_inputs=draw(mm_inputs(len(tokens), block_size)),
    )


@lru_cache(maxsize=512)
def prompts(block_size: int, shared: tuple[tuple[int, ...], ...]) -> st.SearchStrategy[Request]:
    """A new prompt: a system prompt (or none) then the user's tokens, with its LoRA, salt and images.

    The request id is left empty; the machine names each admission.
    """
    return _prompts(block_size, shared)


@lru_cache(maxsize=512)
def chat_turns(block_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    """The tokens one chat turn adds (the model's reply and the user's next message)."""
    return token_ids(1, block_size + 2)


def continue_chat(prompt: Request, turn: tuple[int, ...]) -> Request:
    """The next prompt of a multi-turn chat: the whole earlier prompt, then the new turn.

    >>> continue_chat(Request("", (1, 2)), (3,)).token_ids
    (1, 2, 3)
    """
    return replace(prompt, token_ids=prompt.token_ids + turn)


def _mostly_none(other: st.SearchStrategy[Any], weight: int) -> st.SearchStrategy[Any]:
    """None in `weight` draws of `weight + 1`, else a draw of `other`; it shrinks to None.

    Why not `st.one_of(st.none(), st.none(), ..., other)`: copies of one strategy do not add weight there
    (measured: eight copies of `none()` beside two other strategies gave None in 40% of draws, not 80%).
    """
    return st.sampled_from((False,) * weight + (True,)).flatmap(lambda drawn: other if drawn else st.none())


@lru_cache(maxsize=512)
def external_tokens(max_tokens: int) -> st.SearchStrategy[int]:
    """Tokens an external KV connector loads after the prefix hit: none in a third of the draws, any count up
    to `max_tokens` in a third, all of it in a third (a connector that holds the whole prompt loads all but
    its last token)."""
    if max_tokens <= 0:
        return st.just(0)
    return st.one_of(st.just(0), st.integers(1, max_tokens), st.just(max_tokens))


@lru_cache(maxsize=512)
def hit_caps(num_tokens: int) -> st.SearchStrategy[int | None]:
    """The scheduler's cap on a request's local hit (an external connector's): mostly none, else 0..len - 1."""
    return _mostly_none(st.integers(0, max(num_tokens - 1, 0)), 2)


@lru_cache(maxsize=512)
def hit_limits(num_tokens: int) -> st.SearchStrategy[int | None]:
    """A request's own bound on its prefix hit (vLLM 0.34's `prefix_cache_hit_limit`): mostly none, sometimes 0
    (the request skips the cache: no lookup, no local statistics), else a prompt row within its tokens."""
    # Mostly none: a limited request reads nothing from the connector, and the external loads' branches
    # (a delayed load registered by cache_blocks) must stay within a default campaign's reach.
    return _mostly_none(st.one_of(st.just(0), st.integers(1, max(num_tokens, 1))), 8)


@lru_cache(maxsize=1)
def bad_hit_limits() -> st.SearchStrategy[int]:
    """Hit limits no request may carry: negative (a trace keeps a request's limit as an integer)."""
    return st.sampled_from((-1, -7))


@lru_cache(maxsize=1)
def bad_hit_caps() -> st.SearchStrategy[object]:
    """Caps no scheduler may pass: negative, fractional, boolean, text (None is no cap, valid)."""
    return st.sampled_from((-1, -7, 1.5, True, "2"))


def bad_counts() -> st.SearchStrategy[object]:
    """Counts no caller may pass: negative, fractional, boolean, missing, text."""
    return st.sampled_from((-1, -7, 1.5, True, None, "2"))


def bad_block_id_values(num_gpu_blocks: int) -> tuple[object, ...]:
    """Ids that name no usable block: out of range, the null block, or not an integer.

    >>> bad_block_id_values(4)
    (-1, 4, 7, 0, '1', 1.0, None, True)
    """
    return (-1, num_gpu_blocks, num_gpu_blocks + 3, 0, "1", 1.0, None, True)


@lru_cache(maxsize=512)
def bad_block_ids(num_gpu_blocks: int) -> st.SearchStrategy[object]:
    """A drawn one of `bad_block_id_values`, the null block about half the time.

    Why: the null block is the one bad id that names a block object in every pool
    that has one, so a pool that takes block objects (vLLM's) can be sent no other.
    Drawn one time in eight, a pool that mishandles it inside a list (skips the
    blocks after it, say) went unseen in a 100-example campaign.
    """
    return st.one_of(st.just(NULL_BLOCK_ID), st.sampled_from(bad_block_id_values(num_gpu_blocks)))


# An operation that takes plain ids (evict_blocks) can do something different with each class of
# bad id (a Python list reads -1 as its last element; a bound check fires past the end), so each
# class is a caller mistake of its own there, with its own declared reaction.
PLAIN_ID_MISTAKES = ("bad id", "id past the pool", "negative id")


def plain_bad_id_values(num_gpu_blocks: int, mistake: str) -> tuple[object, ...]:
    """The bad ids of one of `PLAIN_ID_MISTAKES`: together, `bad_block_id_values`.

    >>> [plain_bad_id_values(4, m) for m in PLAIN_ID_MISTAKES]
    [(0, '1', 1.0, None, True), (4, 7), (-1,)]
    """
    assert mistake in PLAIN_ID_MISTAKES, f"mistake={mistake!r} is not a class of bad id"
    values = bad_block_id_values(num_gpu_blocks)
    if mistake == "id past the pool":
        return tuple(v for v in values if type(v) is int and v >= num_gpu_blocks)
    if mistake == "negative id":
        return tuple(v for v in values if type(v) is int and v < 0)
    return tuple(v for v in values if type(v) is not int or 0 <= v < num_gpu_blocks)


@lru_cache(maxsize=512)
def plain_bad_ids(num_gpu_blocks: int, mistake: str) -> st.SearchStrategy[object]:
    """A drawn one of `plain_bad_id_values`."""
    return st.sampled_from(plain_bad_id_values(num_gpu_blocks, mistake))


def bad_hashes() -> st.SearchStrategy[object]:
    """Block hashes of the wrong type (not bytes)."""
    return st.sampled_from(("hash-0", 7, None))


@lru_cache(maxsize=2048)
def other_keys(prompt: Request, block_size: int) -> st.SearchStrategy[Request]:
    """`prompt`'s tokens under one other extra key: another cache_salt, LoRA adapter or image.

    Shrinks toward a changed cache_salt. The new value always differs from the
    prompt's, so the new request's chain must differ from the first block on
    (salt, LoRA) or from the image's first block on (multimodal).
    """
    salts = tuple(v for v in (None, *CACHE_SALTS) if v != prompt.cache_salt)
    loras = tuple(v for v in (None, *LORA_NAMES) if v != prompt.lora_name)
    num_tokens = len(prompt.token_ids)
    images: st.SearchStrategy[tuple[MultiModalInput, ...]] = _images(num_tokens, block_size, 1)
    if prompt.mm_inputs:
        first = prompt.mm_inputs[0]
        other = "img-b" if first.identifier == "img-a" else "img-a"
        images = st.sampled_from(((), (replace(first, identifier=other), *prompt.mm_inputs[1:])))
    return st.one_of(
        st.sampled_from(salts).map(lambda salt: replace(prompt, cache_salt=salt)),
        st.sampled_from(loras).map(lambda lora: replace(prompt, lora_name=lora)),
        images.map(lambda mm: replace(prompt, mm_inputs=mm)),
    )


# --- what the machine draws with ----------------------------------------------------------------

# Rules draw what kind of call to make from a list that starts with "valid",
# repeated so that about three calls in four are valid whatever the number of
# mistake kinds; Hypothesis shrinks toward the first entry, so a shrunk trace
# keeps a mistake only where the failure needs one.
VALID = "valid"


def kinds(*mistakes: str) -> tuple[str, ...]:
    """What kind of call a rule draws: "valid" three times per mistake, then the mistakes.

    >>> kinds("bad id")
    ('valid', 'valid', 'valid', 'bad id')
    """
    return (VALID,) * (3 * max(len(mistakes), 1)) + mistakes


def sampled(items: Sequence[Any]) -> st.SearchStrategy[Any]:
    """`st.sampled_from` over a tuple: Hypothesis caches strategies built from hashable
    arguments, and rebuilding (and re-validating) one per draw dominated a step's cost."""
    return _sampled_tuple(tuple(items))


@lru_cache(maxsize=1024)
def _sampled_tuple(items: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(items)


@lru_cache(maxsize=1024)
def one_of(*strategies: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`st.one_of`, cached for the same reason as `sampled`."""
    return st.one_of(*strategies)
