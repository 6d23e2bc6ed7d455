"""Where a call's torch calls run: counted on the host, on the device, and the waits for the device.

A TorchFunctionMode sees every torch function and tensor method a call makes
(but not `torch.frombuffer`, a constructor outside the override protocol);
metadata reads (`dim`, `numel`, `dtype`) run no operator and are not counted.
A call runs on the device when a tensor going in lives there: on CUDA its
device says so; with two memories on the CPU (`share_host_memory=False`, the
path CUDA takes, so the counts hold on any machine) it is the pool's device
face, or was made from it or uploaded with `.to(device)` (gpu_impl's only
way onto the device; `.cpu()` is its way back). A call on the device that
hands a value to the host (`tolist`, `item`, `cpu`, a tensor's truth value)
waits for the device. `kvspec bench gpu` prints these counts beside its
timings; tests/gpu_impl/test_operator_calls.py holds them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from kvspec.gpu_impl.block_pool import TensorBlockPool

__all__ = ["Costs", "calls_of", "on_the_device"]

_METADATA = {"dim", "numel", "size", "__get__", "is_floating_point"}
# Calls on the device that hand a value to the host: the host waits until the device has run everything queued.
_WAITS = {"cpu", "tolist", "item", "__bool__", "__int__", "__index__", "equal", "nonzero", "unique"}


class Costs(NamedTuple):
    """Torch calls on the host, torch calls on the device, and how many of those wait for the device."""

    host: int
    device: int
    waits: int

    def __str__(self) -> str:
        return f"{self.host}/{self.device}/{self.waits}"


def _tensors(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, torch.Tensor))
    return found


def _gives_device(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An upload: `.to(device)` (gpu_impl's only way onto the device; it comes back with `.cpu()`)."""
    if getattr(func, "__name__", "") != "to":
        return False
    return any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs


class _Tensors:
    """A set of live tensors by identity (a WeakSet compares tensors with ==, elementwise)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}

    def add(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


class _Calls(TorchFunctionMode):
    def __init__(self, device_face: torch.Tensor | None, made: _Tensors) -> None:
        super().__init__()
        self.names: list[str] = []  # every call, in order
        self.on_device: list[str] = []  # the calls that ran on the device
        self.waits: list[str] = []  # the calls on the device that waited for it
        self._face = None if device_face is None else device_face.untyped_storage().data_ptr()
        self._made = made  # tensors made on the device (by calls seen so far)

    def _is_device(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu" or t in self._made:
            return True
        return self._face is not None and t.untyped_storage().data_ptr() == self._face

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        result = func(*args, **kwargs)
        if name == "cpu" and result is args[0] and self._is_device(result):
            result = result.clone()  # two memories on the CPU: what a device hands back is a copy
        if name in _METADATA:
            return result
        self.names.append(name)
        on_device = any(self._is_device(t) for t in _tensors((*args, *kwargs.values())))
        if _gives_device(func, args, kwargs):
            self.on_device.append(name)
            self._made.add(_tensors([result]))
        elif on_device:
            self.on_device.append(name)
            if name in _WAITS:
                self.waits.append(name)
            else:
                self._made.add(_tensors([result]))
        return result

    def costs(self) -> Costs:
        return Costs(len(self.names) - len(self.on_device), len(self.on_device), len(self.waits))


_MADE: weakref.WeakKeyDictionary[TensorBlockPool, _Tensors] = weakref.WeakKeyDictionary()


def calls_of(call: Callable[[], object], pool: TensorBlockPool | None = None) -> _Calls:
    """The torch calls `call` makes; with two memories, `pool`'s device face tells the device calls apart."""
    face = None if pool is None or pool._state.is_shared else pool._state.tensor
    made = _Tensors() if pool is None else _MADE.setdefault(pool, _Tensors())
    with _Calls(face, made) as calls:
        call()
    return calls


def on_the_device(p: TensorBlockPool, block_ids: list[int]) -> torch.Tensor:
    """Block ids as a tensor on the pool's device, as a caller holding ids there would pass them."""
    uploaded: list[torch.Tensor] = []
    calls_of(lambda: uploaded.append(p._state.to_device(block_ids)), p)
    return uploaded[0]
