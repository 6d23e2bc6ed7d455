"""The prefix hash chain: what changes a block's hash, what does not, and where it is stable.

Also runs the doctests of every `kvspec.spec` module, so the examples in the
spec's docstrings stay true.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.spec import manager
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.hashing import (
    DEFAULT_SEED,
    HASH_FUNCTIONS,
    MultiModalInput,
    block_extra_keys,
    hash_block_tokens,
    hash_request_blocks,
    none_hash,
)

tokens = st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=40)
block_sizes = st.integers(min_value=1, max_value=6)
salts = st.text(alphabet="abc", min_size=1, max_size=3)
hash_fns = st.sampled_from(sorted(HASH_FUNCTIONS))


# --- the chain --------------------------------------------------------------------------------


@given(tokens, block_sizes, hash_fns)
def test_only_full_blocks_are_hashed(token_ids: list[int], block_size: int, hash_fn: str) -> None:
    chain = hash_request_blocks(token_ids, block_size, hash_fn=hash_fn)
    assert len(chain) == len(token_ids) // block_size
    # Appending tokens that do not fill a block changes nothing.
    partial = token_ids + [0] * (block_size - 1 - len(token_ids) % block_size)
    assert hash_request_blocks(partial, block_size, hash_fn=hash_fn) == chain


@given(tokens, block_sizes, hash_fns, st.data())
def test_a_changed_token_changes_its_block_and_every_later_one(
    token_ids: list[int], block_size: int, hash_fn: str, data: st.DataObject
) -> None:
    position = data.draw(st.integers(min_value=0, max_value=len(token_ids) - 1), label="position")
    changed = list(token_ids)
    changed[position] += 1
    before = hash_request_blocks(token_ids, block_size, hash_fn=hash_fn)
    after = hash_request_blocks(changed, block_size, hash_fn=hash_fn)
    first_changed = position // block_size
    assert before[:first_changed] == after[:first_changed]  # earlier blocks keep their hash
    # Every later block differs, and (the chain) no later hash of one equals any of the other.
    assert all(a != b for a, b in zip(before[first_changed:], after[first_changed:]))
    assert not set(before[first_changed:]) & set(after)


@given(tokens, block_sizes)
def test_each_hash_chains_on_its_parent(token_ids: list[int], block_size: int) -> None:
    chain = hash_request_blocks(token_ids, block_size)
    parent = none_hash()
    for i, h in enumerate(chain):
        block = token_ids[i * block_size : (i + 1) * block_size]
        assert h == hash_block_tokens(parent, block, None)
        parent = h


def test_sha256_cbor_is_sha256_over_canonical_cbor() -> None:
    # The construction the module documents, written out independently: a chain
    # computed elsewhere from the same definition agrees byte for byte.
    root = hashlib.sha256(cbor2.dumps(DEFAULT_SEED, canonical=True)).digest()
    assert none_hash("sha256_cbor") == root
    first = hashlib.sha256(cbor2.dumps((root, (1, 2, 3, 4), None), canonical=True)).digest()
    salted = hashlib.sha256(cbor2.dumps((root, (1, 2, 3, 4), (("cache_salt", "t1"),)), canonical=True)).digest()
    assert hash_request_blocks([1, 2, 3, 4, 5], 4) == (first,)
    assert hash_request_blocks([1, 2, 3, 4, 5], 4, cache_salt="t1") == (salted,)


def test_the_seed_names_the_chain() -> None:
    assert none_hash(seed="a") != none_hash(seed="b")
    assert hash_request_blocks([1, 2], 2, seed="a") != hash_request_blocks([1, 2], 2, seed="b")


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_block_size_is_refused(bad: object) -> None:
    with pytest.raises(InvalidRequest, match=rf"^block_size must be a positive integer; got block_size={bad!r}$"):
        hash_request_blocks([1, 2], bad)  # type: ignore[arg-type]


def test_an_unknown_hash_function_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"^unknown hash_fn='md5'; known: builtin, sha256, sha256_cbor$"):
        none_hash("md5")


# --- extra keys -------------------------------------------------------------------------------


def test_lora_is_on_every_block() -> None:
    assert [block_extra_keys(s, s + 4, lora_name="l") for s in (0, 4, 8)] == [(("lora", "l"),)] * 3
    base = hash_request_blocks(list(range(12)), 4)
    lora = hash_request_blocks(list(range(12)), 4, lora_name="l")
    assert all(a != b for a, b in zip(base, lora))


def test_a_multimodal_input_keys_only_the_blocks_it_overlaps() -> None:
    image = MultiModalInput("img", offset=6, length=4)  # token positions 6..9: blocks 1 and 2 of size 4
    assert [block_extra_keys(s, s + 4, mm_inputs=[image]) for s in (0, 4, 8, 12)] == [
        None,
        (("mm", "img", 2),),  # starts 2 tokens into block 1
        (("mm", "img", -2),),  # began 2 tokens before block 2
        None,
    ]
    token_ids = list(range(16))
    plain = hash_request_blocks(token_ids, 4)
    with_image = hash_request_blocks(token_ids, 4, mm_inputs=[image])
    other_image = hash_request_blocks(token_ids, 4, mm_inputs=[MultiModalInput("img2", 6, 4)])
    assert plain[0] == with_image[0] == other_image[0]  # block 0 does not see the image
    assert len({plain[1], with_image[1], other_image[1]}) == 3  # block 1 does, by identifier
    # Block 3 does not overlap the image, but chains on block 2, which does.
    assert with_image[3] != plain[3]


def test_the_same_image_at_another_offset_is_another_block() -> None:
    at_5 = block_extra_keys(4, 8, mm_inputs=[MultiModalInput("img", 5, 2)])
    at_6 = block_extra_keys(4, 8, mm_inputs=[MultiModalInput("img", 6, 2)])
    assert at_5 != at_6


def test_cache_salt_is_on_the_first_block_only() -> None:
    assert block_extra_keys(0, 4, cache_salt="t1") == (("cache_salt", "t1"),)
    assert block_extra_keys(4, 8, cache_salt="t1") is None
    assert block_extra_keys(0, 4, lora_name="l", cache_salt="t1") == (("lora", "l"), ("cache_salt", "t1"))


@given(tokens, block_sizes, salts, st.none() | salts)
def test_different_salts_share_no_block_hash(
    token_ids: list[int], block_size: int, salt: str, other: str | None
) -> None:
    if other == salt:
        other = None
    a = hash_request_blocks(token_ids, block_size, cache_salt=salt)
    b = hash_request_blocks(token_ids, block_size, cache_salt=other)
    assert not set(a) & set(b)


@given(tokens, block_sizes, salts)
def test_a_lora_name_and_an_equal_salt_share_no_block_hash(token_ids: list[int], block_size: int, name: str) -> None:
    # Regression: extra keys were untagged, so LoRA "t" and cache_salt "t" gave
    # the first block the same extra keys, ("t",), and the same hash.
    lora = hash_request_blocks(token_ids, block_size, lora_name=name)
    salted = hash_request_blocks(token_ids, block_size, cache_salt=name)
    assert not set(lora) & set(salted)


def test_a_salted_request_does_not_hit_a_lora_requests_blocks() -> None:
    # Regression for the untagged extra keys, at the request level.
    # Steps: X (LoRA "t", 9 tokens) allocates 9 slots -> blocks [1, 2, 3], h(X)1 -> 1,
    # h(X)2 -> 2. Y (cache_salt "t", same 9 tokens) asks for its cached prefix.
    # Expected: no hit ([], 0); before the fix Y hit [1] (4 tokens) and would
    # have read KV computed with X's LoRA.
    state = manager.new_manager(num_gpu_blocks=8, block_size=4)
    prompt = tuple(range(1, 10))
    step = manager.allocate_slots(state, manager.Request("X", prompt, lora_name="t"), 9)
    state, taken = step.state, step.result
    assert taken == (1, 2, 3)
    assert manager.get_computed_blocks(state, manager.Request("Y", prompt, cache_salt="t")).result == ((), 0)
    assert manager.get_computed_blocks(state, manager.Request("Z", prompt, lora_name="t")).result == ((1, 2), 8)


# --- across processes -------------------------------------------------------------------------

_CHILD = """
import json
from kvspec.spec.hashing import HASH_FUNCTIONS, hash_request_blocks
print(json.dumps({fn: [h.hex() for h in hash_request_blocks(list(range(12)), 4, lora_name="l", cache_salt="s",
                                                             hash_fn=fn)] for fn in sorted(HASH_FUNCTIONS)}))
"""


def _chains_in_a_child(pythonhashseed: str) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONHASHSEED": pythonhashseed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    chains: dict[str, list[str]] = json.loads(out.stdout)
    return chains


@pytest.fixture(scope="module")
def chains_by_seed() -> dict[str, list[dict[str, list[str]]]]:
    return {"0": [_chains_in_a_child("0"), _chains_in_a_child("0")], "1": [_chains_in_a_child("1")]}


def test_sha256_chains_agree_across_processes_whatever_the_hash_seed(chains_by_seed) -> None:
    here = {
        fn: [h.hex() for h in hash_request_blocks(list(range(12)), 4, lora_name="l", cache_salt="s", hash_fn=fn)]
        for fn in ("sha256", "sha256_cbor")
    }
    for runs in chains_by_seed.values():
        for chains in runs:
            assert {fn: chains[fn] for fn in here} == here


def test_builtin_chains_agree_only_under_the_same_pythonhashseed(chains_by_seed) -> None:
    (first, second), (other,) = chains_by_seed["0"], chains_by_seed["1"]
    assert len(first["builtin"]) == 3
    assert first["builtin"] == second["builtin"]
    assert not set(first["builtin"]) & set(other["builtin"])
