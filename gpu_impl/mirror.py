"""The pool's state as one int64 array with two faces: host memory for Python, a device tensor for kernels.

Design choice: every per-block field of a TensorBlockPool (ref counts, hash
flags, corrupt flags) and of its free queue (each free block's key, the
key -> block index) lives in one flat int64 array. Its host face is an
`array.array` that Python reads and writes at about 0.03 us an entry; its
device face is a tensor that batched kernels read and write. A short batch
(a request's blocks) runs as Python over the host face, because a torch
operator costs about 2-3 us on the CPU (5-10 us of launch on CUDA) however
few blocks it touches; a long batch runs as kernels over the device face.

On the CPU the two faces are one memory (`torch.frombuffer` over the array):
a write through either is a write to both, and nothing is ever copied. On
CUDA they are two memories: an operation marks the entries it wrote (host
indices, or device index tensors), and the marked entries are copied across.

- Written on the host (a short call): nothing is copied then. The marks
  wait until the device face is next read (`device_face`, which every reader
  of the device face calls first: a long batch's kernels, a snapshot, a
  check) and go across in one copy for all the short calls since: one pinned
  staging tensor of (indices, values), one asynchronous host-to-device copy,
  one `index_copy_` on the device, and no wait for the device. So a short
  call does no device work at all. Past `_LAZY_HOST_MAX` marks they go
  across at once, so the marks a run of short calls leaves stay bounded.
- Written on the device (a long batch): copied back at the end of the batch
  (`sync`): one gather, one device-to-host copy (a wait for the device,
  which a long batch pays anyway for its result), one `index_copy_` on the
  host. The host face, which Python reads, is never behind.

The same code runs on both devices: `share_host_memory=False` keeps two
memories on the CPU too, so the CUDA synchronisation is tested on any machine.

Rejected: device tensors only (the previous design), where every call pays
the operator floor, 15-35 us on the CPU, 7-13x the reference's time for one
block; a host-only pool, which gives up the kernels for long batches; and one
tensor per field in its own dtype, where a synchronisation costs a copy and a
scatter per field written instead of one of each in all. The price of one
dtype is memory: a flag takes 8 bytes.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from typing import Any, overload

import torch

__all__ = ["DeviceFaceView", "MirroredState"]

# Up to this many host-written entries, a sync stages them from a Python list
# (one torch call); beyond it, with tensor gathers (no per-entry Python work).
_LIST_PUSH_MAX = 4096
# Host-written entries left waiting for the device face's next read, at most
# (then they go across at once): a run of short calls never reads the device.
_LAZY_HOST_MAX = 1 << 16


class MirroredState:
    """A flat int64 array on the host and its copy on the device (the same memory on the CPU)."""

    def __init__(self, length: int, device: torch.device, share_host_memory: bool | None = None) -> None:
        """Zero `length` entries on both faces.

        Args:
            length: entries.
            device: where the device face lives.
            share_host_memory: one memory for both faces; None for the default (the CPU
                shares, CUDA cannot). False on the CPU keeps two, as on CUDA (for tests).

        Raises:
            ValueError: share_host_memory=True on a device other than the CPU.

        Cost: O(length).
        """
        shared = device.type == "cpu" if share_host_memory is None else share_host_memory
        if shared and device.type != "cpu":
            raise ValueError(f"share_host_memory=True but device={device} has its own memory; only the CPU shares")
        self.device = device  # fixed
        self.is_shared = shared  # fixed: one memory, nothing to synchronise
        self._buffer = array.array("q", [0]) * length  # the host face's memory (never resized: torch views it)
        self.host = memoryview(self._buffer)  # Python reads and writes here, O(1) each
        # The host face as a CPU tensor over the same memory, for tensor operations on the host.
        self.host_tensor = (
            torch.frombuffer(self._buffer, dtype=torch.int64) if length else torch.zeros(0, dtype=torch.int64)
        )
        # The device face: the host tensor itself when shared, else a memory of its own (see upload).
        self.tensor = self.host_tensor if shared else torch.zeros(length, dtype=torch.int64, device=device)
        self._pin = device.type == "cuda"  # staging in pinned memory: the copy to the device needs no wait
        self._host_marks: list[int] = []  # indices written on the host since the last sync
        self._host_mark_tensors: list[torch.Tensor] = []  # the same, as CPU index tensors (long batches)
        self._device_marks: list[torch.Tensor] = []  # device index tensors written on the device since the last sync

    # --- marking what an operation wrote (only when the faces are two memories) ---------------------------

    def wrote_host(self, indices: Iterable[int]) -> None:
        """Entries written through the host face."""
        self._host_marks.extend(indices)

    def wrote_host_range(self, start: int, end: int) -> None:
        """Entries [start, end) written through the host face."""
        if end - start <= 64:
            self._host_marks.extend(range(start, end))
        elif end > start:
            self._host_mark_tensors.append(torch.arange(start, end, dtype=torch.int64))

    def wrote_host_tensor(self, indices: torch.Tensor) -> None:
        """Entries written through the host face, as a CPU int64 tensor."""
        self._host_mark_tensors.append(indices)

    def wrote_device(self, indices: torch.Tensor) -> None:
        """Entries written through the device face, as a device int64 tensor."""
        self._device_marks.append(indices)

    def wrote_device_range(self, start: int, end: int) -> None:
        """Entries [start, end) written through the device face."""
        if end > start:
            self._device_marks.append(torch.arange(start, end, dtype=torch.int64, device=self.device))

    # --- copying ------------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Copy every marked entry to the other face; both faces are then equal. No-op when shared.

        An operation writes through one face only, so no entry is marked on both.
        """
        if self._host_marks or self._host_mark_tensors:
            self._push()
        if self._device_marks:
            self._pull()

    def host_written(self) -> None:
        """The end of an operation that wrote through the host face only: its marks wait for `device_face`
        (no device work now), unless `_LAZY_HOST_MAX` are waiting."""
        if len(self._host_marks) > _LAZY_HOST_MAX or len(self._host_mark_tensors) > 64:
            self._push()

    def device_face(self) -> None:
        """Bring the device face up to date before it is read: the host's waiting writes go across, in one
        copy. Every reader of the device face calls it first. O(1) when nothing waits (and when shared)."""
        if self._host_marks or self._host_mark_tensors:
            self._push()

    def _push(self) -> None:
        marks, tensors = self._host_marks, self._host_mark_tensors
        if not tensors and len(marks) <= _LIST_PUSH_MAX:
            host = self.host
            staged = torch.tensor((marks, [host[i] for i in marks]), dtype=torch.int64, pin_memory=self._pin)
        else:
            parts = [torch.tensor(marks, dtype=torch.int64)] if marks else []
            indices = torch.cat(parts + tensors)
            staged = torch.stack((indices, self.host_tensor[indices]))
            if self._pin:
                staged = staged.pin_memory()
        marks.clear()
        tensors.clear()
        # NOTE: the staging tensor may be freed as soon as the copy is queued:
        # torch's pinned-memory allocator reuses its block only after the copy ran.
        indices, values = staged.to(self.device, non_blocking=True).unbind()
        self.tensor.index_copy_(0, indices, values)

    def _pull(self) -> None:
        marks = self._device_marks
        indices = marks[0] if len(marks) == 1 else torch.cat(marks)
        marks.clear()
        indices, values = torch.stack((indices, self.tensor[indices])).cpu().unbind()  # waits for the device
        self.host_tensor.index_copy_(0, indices, values)

    def upload(self, start: int, end: int) -> None:
        """Copy entries [start, end) of the host face to the device face (an initial state built on the host)."""
        if not self.is_shared:
            self.tensor[start:end].copy_(self.host_tensor[start:end])

    def to_device(self, values: Sequence[int]) -> torch.Tensor:
        """Ints from the host as an int64 tensor on the device, in one torch call (two on CUDA, neither waits).

        Raises:
            OverflowError: a value is beyond int64.
        """
        if not values:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self.device.type == "cpu":
            return torch.frombuffer(array.array("q", values), dtype=torch.int64)
        return torch.tensor(values, dtype=torch.int64, pin_memory=self._pin).to(self.device, non_blocking=True)

    # --- checking -----------------------------------------------------------------------------------------

    def representation_errors(self) -> list[str]:
        """Where the two faces differ once the device face is read, or device writes were left on the device
        (for check_invariants). Cost: O(length)."""
        errors: list[str] = []
        self.device_face()  # a check reads the device face: the host's waiting writes go across first
        if self._device_marks:
            errors.append("entries written on the device were not copied back to the host face")
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
