"""The linked free queue against a Python list: every operation, in random sequences.

The list is the oracle (obviously right, O(n) where the queue is O(1)); after
every operation the queue must hold the same blocks in the same order, count
them, answer membership, and leave removed blocks unlinked.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.reference.free_queue import FreeKVCacheBlockQueue, KVCacheBlock

NUM_BLOCKS = 12


def queue_of(ids: list[int]) -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(NUM_BLOCKS)]
    return FreeKVCacheBlockQueue([blocks[i] for i in ids]), blocks


def assert_matches(queue: FreeKVCacheBlockQueue, blocks: list[KVCacheBlock], model: list[int]) -> None:
    assert [b.block_id for b in queue] == model
    assert queue.num_free_blocks == len(model)
    for block in blocks:
        assert (block in queue) == (block.block_id in model)
        if block.block_id not in model:
            assert block.prev_free_block is None and block.next_free_block is None
    # The backward links agree with the forward ones.
    backward = []
    node = queue._tail.prev_free_block
    while node is not None and node is not queue._head:
        backward.append(node.block_id)
        node = node.prev_free_block
    assert backward[::-1] == model


def test_construction_keeps_the_given_order() -> None:
    queue, blocks = queue_of([3, 1, 2])
    assert_matches(queue, blocks, [3, 1, 2])
    empty, blocks = queue_of([])
    assert_matches(empty, blocks, [])


def test_each_operation_on_named_blocks() -> None:
    queue, blocks = queue_of([1, 2, 3, 4, 5])
    assert queue.popleft() is blocks[1]
    assert_matches(queue, blocks, [2, 3, 4, 5])
    queue.remove(blocks[4])  # from the middle
    assert_matches(queue, blocks, [2, 3, 5])
    assert [b.block_id for b in queue.popleft_n(2)] == [2, 3]
    assert_matches(queue, blocks, [5])
    queue.prepend_n([blocks[7], blocks[6]])  # the first given is taken first
    assert_matches(queue, blocks, [7, 6, 5])
    queue.append_n([blocks[8], blocks[9]])
    assert_matches(queue, blocks, [7, 6, 5, 8, 9])
    queue.append(blocks[1])
    assert_matches(queue, blocks, [7, 6, 5, 8, 9, 1])
    queue.remove(blocks[1])  # the right end
    queue.remove(blocks[7])  # the left end
    assert_matches(queue, blocks, [6, 5, 8, 9])
    assert queue.popleft_n(0) == []
    queue.prepend_n([])
    queue.append_n([])
    assert_matches(queue, blocks, [6, 5, 8, 9])
    assert [b.block_id for b in queue.popleft_n(4)] == [6, 5, 8, 9]
    assert_matches(queue, blocks, [])
    queue.append_n([blocks[2]])  # an emptied queue takes blocks again
    queue.prepend_n([blocks[3]])
    assert_matches(queue, blocks, [3, 2])


def test_misuse_is_an_assertion_not_a_silent_corruption() -> None:
    # The pool validates its callers; the queue's own asserts guard the pool.
    queue, blocks = queue_of([1])
    with pytest.raises(AssertionError, match=r"^remove: block 2 is not queued$"):
        queue.remove(blocks[2])
    with pytest.raises(AssertionError, match=r"^popleft_n\(n=2\) with 1 free$"):
        queue.popleft_n(2)
    queue.popleft()
    with pytest.raises(AssertionError, match=r"^popleft on an empty free queue$"):
        queue.popleft()
    assert_matches(queue, blocks, [])


@st.composite
def operations(draw: st.DrawFn) -> tuple[list[int], list[tuple[str, list[int] | int]]]:
    """An initial queue and a sequence of operations, each valid for the list model at that point."""
    initial = list(draw(st.permutations(range(NUM_BLOCKS))))[: draw(st.integers(0, NUM_BLOCKS))]
    model = list(initial)
    ops: list[tuple[str, list[int] | int]] = []
    for _ in range(draw(st.integers(0, 25))):
        outside = [b for b in range(NUM_BLOCKS) if b not in model]
        choices = ["append_n", "prepend_n"] + (["append"] if outside else [])
        if model:
            choices += ["popleft", "popleft_n", "remove"]
        op = draw(st.sampled_from(choices))
        if op == "popleft":
            arg: list[int] | int = model.pop(0)
        elif op == "popleft_n":
            n = draw(st.integers(0, len(model)))
            arg, model[:] = n, model[n:]
        elif op == "remove":
            b = draw(st.sampled_from(model))
            model.remove(b)
            arg = b
        elif op == "append":
            b = draw(st.sampled_from(outside))
            model.append(b)
            arg = b
        else:
            picked = list(draw(st.permutations(outside)))[: draw(st.integers(0, len(outside)))]
            model[:] = (model + picked) if op == "append_n" else (picked + model)
            arg = picked
        ops.append((op, arg))
    return initial, ops


@given(operations())
def test_the_queue_behaves_like_a_list(case: tuple[list[int], list[tuple[str, list[int] | int]]]) -> None:
    initial, ops = case
    queue, blocks = queue_of(initial)
    model = list(initial)
    assert_matches(queue, blocks, model)
    for op, arg in ops:
        if op == "popleft":
            assert queue.popleft().block_id == model.pop(0)
        elif op == "popleft_n":
            assert isinstance(arg, int)
            assert [b.block_id for b in queue.popleft_n(arg)] == model[:arg]
            del model[:arg]
        elif op == "remove":
            assert isinstance(arg, int)
            queue.remove(blocks[arg])
            model.remove(arg)
        elif op == "append":
            assert isinstance(arg, int)
            queue.append(blocks[arg])
            model.append(arg)
        elif op == "append_n":
            assert isinstance(arg, list)
            queue.append_n([blocks[b] for b in arg])
            model.extend(arg)
        else:
            assert isinstance(arg, list)
            queue.prepend_n([blocks[b] for b in arg])
            model[:0] = arg
        assert_matches(queue, blocks, model)
