"""The two faces of a MirroredState agree whenever the device face is read, however the host wrote.

Hypothesis draws a run of writes through the host face, each marked the way
gpu_impl marks it (a block's row, a single entry, a range, a tensor write
replayed), and reads the device face at random points: both ways of staging
a push (a few entries from a list, many gathered) and the bound that pushes
at once are reached.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.gpu_impl.mirror import MirroredState

WIDTH, ROWS, EXTRA = 4, 12, 9  # a block's four fields, twelve blocks, then nine single entries
LENGTH = WIDTH * ROWS + EXTRA

rows = st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=8)
entries = st.lists(st.integers(0, LENGTH - 1), min_size=1, max_size=8)
value = st.integers(-(2**63), 2**63 - 1)
writes = st.one_of(
    st.tuples(st.just("rows"), rows, value),
    st.tuples(st.just("entries"), entries, value),
    st.tuples(st.just("range"), st.integers(0, LENGTH), st.integers(0, 80), value),
    st.tuples(st.just("tensor"), entries, value),
    st.tuples(
        st.just("read"),
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(writes, max_size=40))
def test_the_device_face_equals_the_host_face_at_every_read(run: list[tuple]) -> None:
    state = MirroredState(LENGTH, torch.device("cpu"), share_host_memory=False, row_width=WIDTH)
    host = state.host
    for write in run:
        kind = write[0]
        rows_written: list[int] = []
        if kind == "rows":
            _, marked, v = write
            for r in marked:
                host[WIDTH * r + v % WIDTH] = v  # one field of the block; the row is marked
            rows_written = marked
        elif kind == "entries":
            _, marked, v = write
            for i in marked:
                host[i] = v
            state.wrote_host(marked)
        elif kind == "range":
            _, start, length, v = write
            end = min(start + length, LENGTH)
            for i in range(start, end):
                host[i] = v
            state.wrote_host_range(start, end)
        elif kind == "tensor":
            _, marked, v = write
            index = torch.tensor(sorted(set(marked)), dtype=torch.int64)
            state.apply(state.host_tensor, state.tensor, "index_fill_", 0, index, v)
        else:
            state.device_face()
            assert torch.equal(state.tensor, state.host_tensor)
        state.host_written(rows_written)  # the end of an operation: may push at once past the bounds
    state.device_face()
    assert torch.equal(state.tensor, state.host_tensor)
    assert state.representation_errors() == []
