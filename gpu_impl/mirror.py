"""The pool's state as one int64 array with two faces: host memory where every decision is made, a device
tensor that follows it for device code.

Design choice: every per-block field of a TensorBlockPool (ref counts, hash
flags, corrupt flags) and of its free queue (each free block's key, the
key -> block index) lives in one flat int64 array. Its host face is an
`array.array` that Python reads and writes at about 0.03 us an entry, and a
CPU tensor over the same memory (`torch.frombuffer`) for batched operations;
its device face is a tensor that device code reads (the pool's own checks,
`writable_mask`, a scheduler's kernels). A short batch (a request's blocks)
runs as Python over the host face, because a torch operator costs about
2-3 us on the CPU however few blocks it touches; a long batch runs as tensor
operations over the host face.

Why every operation decides on the host, the long ones too: the host face is
current after every call (short calls read it with no device work), so
whatever a long batch changes, the host must apply in O(batch) anyway. Run
on the device instead, a long batch would pay that same host work (as a copy
back and a scatter) and, on top, a wait for the device for every answer the
host needs before it may return (the checks, the counts that size the
queue's batches, the ids handed back): the previous design, five or six
waits per call on CUDA. Deciding on the host costs none: the device face
only follows.

On the CPU the two faces are one memory: a write through either is a write
to both, and nothing is ever copied. On CUDA they are two memories, and
what the host wrote waits there until the device face is next read
(`device_face`, which every reader of it calls first: `DeviceFaceView`).
Then it goes across with no wait for the device: the tensor operations
(`apply`) are replayed on the device face in their order, their tensor
arguments uploaded in one asynchronous copy for all of them, one kernel
each; the entries Python wrote follow as one pinned staging tensor of
(indices, values), one copy and one `index_copy_`. Python marks a block it
wrote as one row (the rows an operation hands `host_written` at its end: a
block's fields are a row of the array, and the push expands it), any other
entry by its index (`wrote_host`). Past
`_LAZY_HOST_MAX` entries, `_LAZY_REPLAYS_MAX` operations, or as many
replayed entries as the state has, they go at once, so what waits stays
bounded. Nothing is ever copied back: the device face is written by
nothing else.

The same code runs on both devices: `share_host_memory=False` keeps two
memories on the CPU too, so the CUDA synchronisation is tested on any machine.

Rejected: long batches as kernels over the device face (the previous
design; the waits above, and its host face a copy behind after every long
call until the copy back); device tensors only (the design before that),
where every call paid the operator floor, 15-35 us on the CPU, 7-13x the
reference's time for one block; and one tensor per field in its own dtype,
where a synchronisation costs a copy and a scatter per field written
instead of one of each in all. The price of one dtype is memory: a flag
takes 8 bytes.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, overload

import torch

__all__ = ["DeviceFaceView", "MirroredState", "Ones"]

# Up to this many entries written by Python, a push stages them from a Python list
# (one torch call); beyond it, with a tensor gather (no per-entry Python work).
# Measured (torch 2.13, one thread): 4 entries 3.9 us against 5.2; 64 entries
# 11.7 us against 6.8; 5,000 entries 784 us against 179.
_LIST_PUSH_MAX = 16
# Entries written by Python left waiting for the device face's next read, at most
# (then they go across at once): a run of short calls never reads the device.
_LAZY_HOST_MAX = 1 << 16
# Tensor writes left waiting, at most: each is one kernel when replayed.
_LAZY_REPLAYS_MAX = 256
_CPU = torch.device("cpu")


class Ones(NamedTuple):
    """k ones, as an argument of `MirroredState.apply`: each face uses a ones tensor of its own."""

    k: int


class _Replay(NamedTuple):
    """A tensor write of the host face, to run again on the device face: `view.method(*args, **kwargs)`."""

    view: torch.Tensor
    method: str
    args: tuple[object, ...]
    kwargs: dict[str, object]


class MirroredState:
    """A flat int64 array on the host and its copy on the device (the same memory on the CPU)."""

    def __init__(
        self, length: int, device: torch.device, share_host_memory: bool | None = None, row_width: int = 1
    ) -> None:
        """Zero `length` entries on both faces.

        Args:
            length: entries.
            device: where the device face lives.
            share_host_memory: one memory for both faces; None for the default (the CPU
                shares, CUDA cannot). False on the CPU keeps two, as on CUDA (for tests).
            row_width: entries [w * r, w * r + w) are row r (a block's fields), which
                `host_written` marks as one; 1: every entry is a row.

        Raises:
            ValueError: share_host_memory=True on a device other than the CPU.

        Cost: O(length).
        """
        shared = device.type == "cpu" if share_host_memory is None else share_host_memory
        if shared and device.type != "cpu":
            raise ValueError(f"share_host_memory=True but device={device} has its own memory; only the CPU shares")
        self.device = device  # fixed
        self.is_shared = shared  # fixed: one memory, nothing to synchronise
        self.row_width = row_width  # fixed: see host_written
        self._length = length  # fixed
        self._buffer = array.array("q", [0]) * length  # the host face's memory (never resized: torch views it)
        self.host = memoryview(self._buffer)  # Python reads and writes here, O(1) each
        # The host face as a CPU tensor over the same memory, for tensor operations on the host.
        self.host_tensor = (
            torch.frombuffer(self._buffer, dtype=torch.int64) if length else torch.zeros(0, dtype=torch.int64)
        )
        # The device face: the host tensor itself when shared, else a memory of its own (see upload).
        self.tensor = self.host_tensor if shared else torch.zeros(length, dtype=torch.int64, device=device)
        self._pin = device.type == "cuda"  # staging in pinned memory: the copy to the device needs no wait
        self._host_marks: list[int] = []  # entries Python wrote since the last push (values read at the push)
        self._row_marks: list[int] = []  # rows Python wrote since the last push (every entry of each goes)
        self._row_offsets = torch.arange(row_width, dtype=torch.int64)  # each entry's place in its row
        self._replays: list[_Replay] = []  # tensor writes since the last push, to run again on the device face
        self._num_replayed = 0  # entries the replays' tensor arguments hold
        self._ones = {"host": torch.ones(0, dtype=torch.int64), "device": torch.ones(0, dtype=torch.int64)}

    # --- what an operation wrote (kept only when the faces are two memories) ------------------------------

    def wrote_host(self, indices: Iterable[int]) -> None:
        """Entries Python wrote through the host face (`host`): their values go across at the next push."""
        if not self.is_shared:
            self._host_marks.extend(indices)

    def wrote_host_range(self, start: int, end: int) -> None:
        """Entries [start, end) Python wrote through the host face."""
        if self.is_shared or end <= start:
            return
        if end - start <= 64:
            self._host_marks.extend(range(start, end))
        else:  # a long run: its values as they are now, replayed as one slice write
            self._record(self.tensor, "__setitem__", (slice(start, end), self.host_tensor[start:end].clone()), {})

    def apply(
        self, host_view: torch.Tensor, device_view: torch.Tensor, method: str, *args: object, **kwargs: Any
    ) -> None:
        """A tensor write through the host face, `host_view.method(*args, **kwargs)`, run again on the
        device face as `device_view.method(...)` at the next push.

        The two views are the same field of the two faces. Tensor arguments are int64 CPU tensors that
        nobody writes afterwards; the push uploads them all in one copy. `Ones(k)` stands for k ones, each
        face's own (nothing uploaded). In one memory the host's write is all there is.
        """
        getattr(host_view, method)(*self._resolve(args, "host"), **kwargs)
        if not self.is_shared:
            self._record(device_view, method, args, kwargs)

    def _record(self, view: torch.Tensor, method: str, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self._replays.append(_Replay(view, method, args, kwargs))
        self._num_replayed += sum(a.numel() for a in args if isinstance(a, torch.Tensor))

    def _resolve(self, args: tuple[object, ...], face: str) -> list[object]:
        return [self._ones_of(a.k, face) if isinstance(a, Ones) else a for a in args]

    def _ones_of(self, k: int, face: str) -> torch.Tensor:
        ones = self._ones[face]
        if ones.numel() < k:
            device = self.device if face == "device" else _CPU
            ones = self._ones[face] = torch.ones(max(k, 2 * ones.numel()), dtype=torch.int64, device=device)
        return ones[:k]

    # --- copying ------------------------------------------------------------------------------------------

    def host_written(self, rows: Iterable[int] = ()) -> None:
        """The end of an operation, with the rows Python wrote through the host face in it.

        The rows are a short call's one mark: every entry of each goes across at the next push, one row per
        block the call wrote, with no index arithmetic in Python (a row is a block's fields; the push
        expands it), and an entry that did not change goes across unchanged.

        The operation's writes wait for `device_face` (no device work now), unless more wait than
        `_LAZY_HOST_MAX` entries in Python, `_LAZY_REPLAYS_MAX` tensor writes, or as many entries in their
        arguments as the state has; then they go at once.
        """
        if self.is_shared:
            return
        self._row_marks.extend(rows)
        if (
            len(self._host_marks) + self.row_width * len(self._row_marks) > _LAZY_HOST_MAX
            or len(self._replays) > _LAZY_REPLAYS_MAX
            or self._num_replayed > self._length
        ):
            self._push()

    def device_face(self) -> None:
        """Bring the device face up to date before it is read: the host's waiting writes go across, in one
        copy. Every reader of the device face calls it first. O(1) when nothing waits (and when shared)."""
        if self._host_marks or self._row_marks or self._replays:
            self._push()

    def _push(self) -> None:
        """The waiting writes onto the device face: the tensor writes replayed in their order, then the
        entries Python wrote, with their values now (the host's: so an entry written both ways ends equal)."""
        self._replay()
        marks, rows, width = self._host_marks, self._row_marks, self.row_width
        if not marks and not rows:
            return
        if len(marks) + width * len(rows) <= _LIST_PUSH_MAX:
            host = self.host
            marks += [width * r + j for r in rows for j in range(width)]
            staged = torch.tensor((marks, [host[i] for i in marks]), dtype=torch.int64, pin_memory=self._pin)
        else:  # the indices through an array (a C loop), the values gathered by one tensor operation
            parts = []
            if rows:  # each row's entries
                first = torch.frombuffer(array.array("q", rows), dtype=torch.int64)
                parts.append(first if width == 1 else (first[:, None] * width + self._row_offsets).view(-1))
            if marks:
                parts.append(torch.frombuffer(array.array("q", marks), dtype=torch.int64))
            indices = torch.cat(parts) if len(parts) > 1 else parts[0]
            staged = torch.stack((indices, self.host_tensor[indices]))
            if self._pin:
                staged = staged.pin_memory()
        marks.clear()
        rows.clear()
        # NOTE: the staging tensor may be freed as soon as the copy is queued:
        # torch's pinned-memory allocator reuses its block only after the copy ran.
        indices, values = staged.to(self.device, non_blocking=True, copy=True).unbind()
        self.tensor.index_copy_(0, indices, values)

    def _replay(self) -> None:
        replays = self._replays
        if not replays:
            return
        uploads: dict[int, torch.Tensor] = {}  # every tensor argument once (two writes often share the ids)
        for r in replays:
            for a in r.args:
                if isinstance(a, torch.Tensor):
                    uploads.setdefault(id(a), a)
        on_device: dict[int, torch.Tensor] = {}
        if uploads:
            tensors = list(uploads.values())
            staged = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            if self._pin:
                staged = staged.pin_memory()
            parts = torch.split(staged.to(self.device, non_blocking=True, copy=True), [t.numel() for t in tensors])
            on_device = dict(zip(uploads, parts))
        for r in replays:
            args = [
                on_device[id(a)]
                if isinstance(a, torch.Tensor)
                else self._ones_of(a.k, "device")
                if isinstance(a, Ones)
                else a
                for a in r.args
            ]
            getattr(r.view, r.method)(*args, **r.kwargs)
        replays.clear()
        self._num_replayed = 0

    def upload(self, start: int, end: int) -> None:
        """Copy entries [start, end) of the host face to the device face (an initial state built on the host)."""
        if not self.is_shared:
            self.tensor[start:end].copy_(self.host_tensor[start:end])

    # --- ids between the host and the device (the only other copies) -----------------------------------

    def to_device(self, values: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Ints from the host (a list, or a CPU int64 tensor) as an int64 tensor on the device; no wait.

        Shared: the list in one torch call (`frombuffer`), the tensor itself. Two memories: staged (in
        pinned memory on CUDA) and copied asynchronously.

        Raises:
            OverflowError: a value is beyond int64.
        """
        if isinstance(values, torch.Tensor):
            if self.is_shared:
                return values
            return (values.pin_memory() if self._pin else values).to(self.device, non_blocking=True, copy=True)
        if not values:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self.is_shared:
            return torch.frombuffer(array.array("q", values), dtype=torch.int64)
        return torch.tensor(values, dtype=torch.int64, pin_memory=self._pin).to(self.device, non_blocking=True)

    def to_host(self, values: torch.Tensor) -> torch.Tensor:
        """An int64 tensor of the device (or any device) as a CPU tensor: with two memories, a copy that
        waits for the device (the one wait a call with device ids in pays: its ids must be read before
        anything changes)."""
        host = values.cpu()
        if host is values and not self.is_shared:  # two memories on the CPU: a copy, as a device's would be
            host = host.clone()
        return host if host.dtype == torch.int64 else host.to(torch.int64)

    # --- checking -----------------------------------------------------------------------------------------

    def representation_errors(self) -> list[str]:
        """Where the two faces differ once the device face is brought up to date (for check_invariants).
        Cost: O(length)."""
        errors: list[str] = []
        self.device_face()  # a check reads the device face: the host's waiting writes go across first
        if not self.is_shared:
            differ = torch.nonzero(self.host_tensor != self.tensor.cpu()).squeeze(1)
            if differ.numel():
                i = int(differ[0])
                errors.append(
                    f"{differ.numel()} entries differ between the host and the device face, the first at "
                    f"index {i}: host={self.host[i]} device={int(self.tensor[i])}"
                )
        return errors


class DeviceFaceView:
    """A field of an object's `MirroredState` as its device face: reading it calls `device_face` first.

    Declared on a class as ``ref_cnt = DeviceFaceView("...")``; the view itself lives in the instance's
    ``_ref_cnt`` and the state in its ``_state``. Every reader of the device face goes through one, so no
    kernel reads an entry a short call left waiting on the host.
    """

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self._slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_" + name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> DeviceFaceView: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> torch.Tensor: ...
    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        obj._state.device_face()
        return getattr(obj, self._slot)
