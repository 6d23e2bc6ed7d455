"""KV cache groups in gpu_impl: the layout is checked as the spec checks it, and each group has its own KV memory.

A request has one block table per group over one pool, and each group's
layers their own KV store: a block holds KV in the store of the group that
holds it and nowhere else, a prefix hit reads each group's blocks back from
that group's store (`read_kv`: the flat hit, group by group; a null position
reads as []), and no group ever writes the null block. The lock-step
(test_manager_lockstep) drives random layouts; these are the explicit cases.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.gpu_impl.adapter import make_adapter
from kvspec.gpu_impl.kv_cache import PagedKVCache
from kvspec.gpu_impl.kv_cache_manager import TensorKVCacheManager, prefix_kv_source
from kvspec.reference import KVCacheManager
from kvspec.spec import manager as spec_manager
from kvspec.spec.attention import KVGroup
from kvspec.spec.errors import BlockManagerError, InvalidBlock, InvalidRequest
from kvspec.spec.manager import Request
from kvspec.spec.state import NULL_BLOCK_ID
from tests.gpu_impl._lockstep import same_call

PROMPT = tuple(range(12))  # six blocks of two tokens


def pair(groups: str, num_gpu_blocks: int = 24, block_size: int = 2) -> tuple[KVCacheManager, TensorKVCacheManager]:
    ref = KVCacheManager(num_gpu_blocks, block_size, groups=groups)
    gpu = TensorKVCacheManager(num_gpu_blocks, block_size, device="cpu", groups=groups)
    return ref, gpu


def error_of(build: object) -> tuple[type[BaseException], str]:
    assert callable(build)
    with pytest.raises(BlockManagerError) as e:
        build()
    return type(e.value), str(e.value)


def stores(gpu: TensorKVCacheManager) -> list[torch.Tensor]:
    return [kv.kv.clone() for kv in gpu.kv_caches]


# --- the layout -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "groups",
    [
        "",
        "full,",
        "lru",
        "full:3",
        "sliding",
        "sliding:1",
        "sliding:x",
        "chunked:0",
        "chunked:-4",
        "full,full,full,full",
        "chunked:6",
        "full,chunked:3",
        [KVGroup("chunked", 6)],
        [KVGroup("sliding", 1)],
    ],
    ids=repr,
)
def test_a_bad_layout_is_refused_with_the_specs_error_and_message(groups):
    # block_size 4: a chunk of 6 or 3 tokens is not a multiple of it.
    want = error_of(lambda: spec_manager.new_manager(8, 4, groups=groups))
    assert want[0] is InvalidRequest
    assert error_of(lambda: KVCacheManager(8, 4, groups=groups)) == want
    assert error_of(lambda: TensorKVCacheManager(8, 4, device="cpu", groups=groups)) == want
    if isinstance(groups, str):
        config = AdapterConfig("manager", 8, block_size=4, device="cpu", groups=groups)
        assert error_of(lambda: make_adapter(config)) == want


def test_the_chunk_message_names_the_block_size():
    with pytest.raises(
        InvalidRequest,
        match=r"^KV cache group chunked:6: a chunk of 6 tokens is not a multiple of "
        r"block_size=4 \(vLLM's chunked local attention asserts it",
    ):
        TensorKVCacheManager(8, 4, device="cpu", groups="full,chunked:6")


def test_layouts_as_strings_or_values_and_how_snapshots_name_them():
    gpu = TensorKVCacheManager(8, 2, device="cpu", groups=[KVGroup("full"), KVGroup("sliding", 4)])
    assert gpu.groups == (KVGroup("full"), KVGroup("sliding", 4)) and len(gpu.kv_caches) == 2
    assert gpu.snapshot().kv_groups == ("full", "sliding:4")
    assert gpu.kv_caches[0] is gpu.kv_cache and gpu.kv_caches[1] is not gpu.kv_cache
    assert TensorKVCacheManager(8, 2, device="cpu").snapshot().kv_groups == ()  # the default: one full group
    assert TensorKVCacheManager(8, 2, device="cpu", groups="full").snapshot().kv_groups == ()
    assert TensorKVCacheManager(8, 2, device="cpu", groups="chunked:4").snapshot().kv_groups == ("chunked:4",)
    adapter = make_adapter(AdapterConfig("manager", 8, block_size=2, device="cpu", groups="sliding:3,full"))
    assert isinstance(adapter, TensorKVCacheManager) and adapter.snapshot().kv_groups == ("sliding:3", "full")


# --- bad calls ------------------------------------------------------------------------------------


def started(groups: str) -> tuple[KVCacheManager, TensorKVCacheManager, list[int]]:
    """A request ran its whole prompt and finished; the returned list is a second request's hit on it."""
    ref, gpu = pair(groups)
    for m in (ref, gpu):
        m.allocate_slots(Request("a", PROMPT), len(PROMPT))
        m.free("a")
    hit, num_tokens = same_call(ref, gpu, "get_computed_blocks", Request("b", PROMPT))[1]
    assert num_tokens == 10  # at most len - 1 tokens, whole blocks
    return ref, gpu, hit


def test_a_hit_of_a_sliding_group_has_the_null_block_before_its_window():
    _, gpu, hit = started("full,sliding:4")
    full, sliding = hit[:5], hit[5:]
    assert NULL_BLOCK_ID not in full
    # A window of 4 tokens needs the cdiv(3, 2) = 2 blocks before the next token; the rest is null.
    assert sliding[:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in sliding[3:]
    assert not set(full) & set(sliding[3:])  # groups never share a block


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ("drop one", InvalidRequest, r"but 9 hit blocks of block_size=2 for 2 KV cache groups$"),
        (
            "null where full attention reads",
            InvalidBlock,
            r"hit block_id=0 is not registered under the request's "
            r"hash 0 of KV cache group 0$",
        ),
        ("null where the window reads", InvalidBlock, r"hash 4 of KV cache group 1$"),
        ("swap the groups", InvalidBlock, r"of KV cache group 0$"),
        ("marked id", InvalidRequest, r"contains '#', which names a KV cache group's block table"),
    ],
)
def test_a_bad_hit_with_groups_is_refused_and_changes_nothing(change, error, message):
    ref, gpu, hit = started("full,sliding:4")
    request, bad = Request("b", PROMPT), list(hit)
    if change == "drop one":
        bad = hit[:-1]
    elif change == "null where full attention reads":
        bad[0] = NULL_BLOCK_ID
    elif change == "null where the window reads":
        bad[-1] = NULL_BLOCK_ID
    elif change == "swap the groups":
        bad = hit[5:] + hit[:5]
    else:
        request = Request("b#1", PROMPT)
    before, kv_before = gpu.snapshot(), stores(gpu)
    assert same_call(ref, gpu, "allocate_slots", request, 2, 10, bad) == ("error", error)
    with pytest.raises(error, match=message):
        gpu.allocate_slots(request, 2, 10, bad)
    assert gpu.snapshot() == before == ref.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(stores(gpu), kv_before))
    # The good hit is still served.
    assert same_call(ref, gpu, "allocate_slots", Request("b", PROMPT), 2, 10, hit)[0] == "ok"
    assert gpu.snapshot() == ref.snapshot()


def test_a_marked_request_id_is_refused_only_with_several_groups():
    _, gpu = pair("full,chunked:4")
    with pytest.raises(InvalidRequest, match=r"^get_computed_blocks: request_id='x#1' contains '#'"):
        gpu.get_computed_blocks(Request("x#1", PROMPT))
    with pytest.raises(InvalidRequest, match=r"^allocate_slots: request_id='x#1' contains '#'"):
        gpu.allocate_slots(Request("x#1", PROMPT), 1)
    assert gpu.snapshot().block_tables == ()


# --- KV memory per group --------------------------------------------------------------------------


def test_a_hit_block_reads_back_from_its_own_groups_store_and_only_there():
    _, gpu, hit = started("full,sliding:4")
    request, n = Request("b", PROMPT), len(hit) // 2
    pages = gpu.read_kv(hit)
    for j, (b, page) in enumerate(zip(hit, pages)):
        g, i = divmod(j, n)
        if b == NULL_BLOCK_ID:
            assert page == []
            continue
        expected = prefix_kv_source(request, 2 * i, 2 * i + 2)
        assert page == expected == gpu.kv_caches[g].read_blocks([b]).tolist()[0]
        # The other group never held block b: its page there was never written.
        assert gpu.kv_caches[1 - g].read_blocks([b]).tolist()[0] == [0, 0]


def test_read_kv_splits_the_list_into_the_groups():
    _, gpu, hit = started("full,sliding:4,chunked:2")
    assert len(gpu.read_kv(hit)) == len(hit) == 15
    with pytest.raises(InvalidRequest, match=r"^read_kv: 14 block ids do not split into 3 KV cache groups"):
        gpu.read_kv(hit[:-1])
    with pytest.raises(InvalidBlock, match=r"^read_kv: block_id=99 is not a block of this pool"):
        gpu.read_kv([99, 1, 2])
    assert gpu.read_kv([NULL_BLOCK_ID] * 3) == [[], [], []]
    # One group: any list of blocks, a null position still reads as nothing.
    single = TensorKVCacheManager(8, 2, device="cpu", groups="sliding:3")
    assert single.read_kv([NULL_BLOCK_ID, 1]) == [[], [0, 0]]


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, list[int]]]]:
    """Every block a store is asked to write, as (store, blocks) in call order."""
    seen: list[tuple[int, list[int]]] = []
    original = PagedKVCache.write_tokens

    def spy(self: PagedKVCache, block_table: torch.Tensor, start: int, values: torch.Tensor) -> None:
        end = start + values.shape[0]
        bs = self.block_size
        seen.append((id(self), block_table[start // bs : (end - 1) // bs + 1].tolist()))
        original(self, block_table, start, values)

    monkeypatch.setattr(PagedKVCache, "write_tokens", spy)
    yield seen


@pytest.mark.parametrize(
    ("groups", "num_external"),
    [("full,sliding:3", 8), ("full,chunked:4", 8), ("chunked:4,full", 6), ("sliding:2,chunked:2", 9)],
)
def test_tokens_an_external_cache_loads_at_skipped_positions_are_not_written(writes, groups, num_external):
    ref, gpu = pair(groups)
    request = Request("a", PROMPT)
    # No hit: external tokens first, then the rest of the prompt; a group skips some of the loaded ones.
    new = same_call(ref, gpu, "allocate_slots", request, len(PROMPT) - num_external, 0, [], num_external)[1]
    assert new is not None
    assert gpu.snapshot() == ref.snapshot()
    written = [b for _, blocks in writes for b in blocks]
    assert written and NULL_BLOCK_ID not in written
    for g, kv in enumerate(gpu.kv_caches):
        table = gpu.block_table("a", g)
        assert table == ref.managers[g].req_to_blocks["a"]
        if gpu.groups[g].skips:  # each skipping group skips some of the loaded tokens' blocks
            assert table[0] == NULL_BLOCK_ID
        pages = kv.read_blocks(table).tolist()
        values = prefix_kv_source(request, 0, len(PROMPT))
        for p, v in enumerate(values):
            if table[p // 2] != NULL_BLOCK_ID:
                assert pages[p // 2][p % 2] == v
        assert not bool(kv.kv[NULL_BLOCK_ID].any())


def test_decode_slides_the_window_frees_blocks_and_never_writes_the_null_block(writes):
    ref, gpu = pair("full,sliding:3", num_gpu_blocks=40)
    request = Request("a", PROMPT)
    same_call(ref, gpu, "allocate_slots", request, len(PROMPT))
    for token in range(12):
        request = Request("a", request.token_ids + (token,))
        assert same_call(ref, gpu, "allocate_slots", request, 1)[1] is not None
        assert gpu.snapshot() == ref.snapshot()
    sliding = gpu.block_table("a", 1)
    # 23 tokens computed before the last step: its token (position 23) reads positions 21..23, so the
    # 21 tokens before them, blocks 0..9, were freed; blocks 10 and 11 are held.
    assert len(sliding) == 12 and sliding[:10] == [NULL_BLOCK_ID] * 10 and NULL_BLOCK_ID not in sliding[10:]
    assert NULL_BLOCK_ID not in [b for _, blocks in writes for b in blocks]
    assert all(not bool(kv.kv[NULL_BLOCK_ID].any()) for kv in gpu.kv_caches)
    gpu.check_invariants()


def test_a_flip_in_a_later_groups_store_is_caught_there_and_harmless_elsewhere():
    _, gpu, hit = started("full,sliding:4")
    victim = hit[-1]  # the sliding group's last hit block
    gpu.kv_caches[0].inject_bit_flip(victim, byte_offset=3, bit=1)  # group 0 does not hold it: never read
    assert gpu.get_computed_blocks(Request("b", PROMPT)) == (hit, 10)
    assert gpu.snapshot().quarantined == ()
    gpu.kv_caches[1].inject_bit_flip(victim, byte_offset=3, bit=1)  # where its KV lives
    again, num_tokens = gpu.get_computed_blocks(Request("c", PROMPT))
    assert gpu.snapshot().quarantined == (victim,)
    # The window now ends a block earlier, so the agreed hit is 8 tokens: the full group's first four
    # blocks, and the sliding group's blocks at positions 2 and 3 (the first was null in the first hit).
    assert num_tokens == 8 and again[:4] == hit[:4] and again[4:6] == [NULL_BLOCK_ID] * 2 and again[7] == hit[8]
    for j, (b, page) in enumerate(zip(again, gpu.read_kv(again))):
        i = j % 4
        assert page == ([] if b == NULL_BLOCK_ID else prefix_kv_source(Request("c", PROMPT), 2 * i, 2 * i + 2))
    gpu.check_invariants()
