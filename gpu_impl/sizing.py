"""How many KV blocks fit on a device (seed 002's sizing rule).

    num_gpu_blocks = floor((memory - weights - runtime overhead) x (1 - margin) / block bytes)
    block bytes    = 2 (K and V) x layers x kv_heads x head_dim x block_size x dtype size

`memory` is what the caller states (`--gpu-mem`), or, on CUDA, the device's
free memory as the driver reports it (torch.cuda.mem_get_info) at the time of
the call; weights and overhead are subtracted from it as given (pass 0 for
weights already loaded). The margin (20% by default) is the headroom seed 002
keeps for peaks. All arithmetic is exact (integers and fractions), so the
same arguments give the same count everywhere.

Bad sizes are caller mistakes and raise `InvalidRequest` naming the values
seen: an unreadable size, a non-positive dimension, a margin outside [0, 1),
weights and overhead that leave no memory, or a budget that fits fewer than
two blocks (the null block and one usable block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from kvspec.spec.errors import InvalidRequest, is_int

__all__ = [
    "DEFAULT_MARGIN",
    "DTYPE_SIZES",
    "CapacityPlan",
    "KVLayout",
    "device_free_memory",
    "format_size",
    "parse_size",
    "plan_capacity",
]

DEFAULT_MARGIN = 0.2

# Bytes per element of each KV cache dtype, under the names vLLM's
# --kv-cache-dtype and torch use.
DTYPE_SIZES: dict[str, int] = {
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, name: str = "size") -> int:
    """A size in bytes from "141GiB", "16GB", "512MiB", "1.5TiB" or a plain byte count.

    Units are decimal (KB, MB, GB, TB) or binary (KiB, MiB, GiB, TiB), any case.

    Raises:
        InvalidRequest: the text is not a non-negative number with a known unit.

    >>> parse_size("141GiB"), parse_size("2GB"), parse_size("1.5KiB"), parse_size(4096)
    (151397597184, 2000000000, 1536, 4096)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidRequest(f"{name}={text} bytes is negative")
        return int(text)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidRequest(
            f"cannot read {name}={text!r}: expected a number and a unit such as 141GiB, 16GB or 512MiB"
        )
    return int(Fraction(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: int) -> str:
    """A byte count in the largest binary unit that keeps it >= 1, two decimals.

    >>> format_size(151397597184), format_size(2097152), format_size(100)
    ('141.00 GiB', '2.00 MiB', '100 B')
    >>> format_size(10**400)[-8:]  # a count typed as 1e400 is beyond a float: whole TiB, in integers
    '0000 TiB'
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            try:
                return f"{num_bytes / scale:.2f} {unit}"
            except OverflowError:
                return f"{round(num_bytes) // scale} {unit}"
    return f"{num_bytes} B"


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of a model's paged KV cache: what one block of it holds."""

    num_layers: int  # attention layers with a KV cache
    num_kv_heads: int  # KV heads per layer (after GQA)
    head_dim: int  # elements per head
    block_size: int  # tokens per block
    dtype: str = "bf16"  # the KV cache element type (DTYPE_SIZES)

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if not is_int(value) or value < 1:
                raise InvalidRequest(f"{field} must be a positive integer; got {field}={value!r}")
        if self.dtype not in DTYPE_SIZES:
            known = ", ".join(sorted(DTYPE_SIZES))
            raise InvalidRequest(f"unknown KV cache dtype={self.dtype!r}; known: {known}")

    @property
    def dtype_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def slot_shape(self) -> tuple[int, int, int, int]:
        """The KV of one token: (K and V, layers, kv_heads, head_dim)."""
        return (2, self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """2 x layers x kv_heads x head_dim x block_size x dtype size.

        >>> KVLayout(32, 8, 128, 16, "bf16").block_bytes
        2097152
        """
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * self.dtype_size


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """The sizing computation, every term kept so it can be printed and checked."""

    layout: KVLayout  # what one block holds
    memory_bytes: int  # the memory budget before deductions
    memory_source: str  # where memory_bytes came from ("--gpu-mem", or the device's free memory)
    weights_bytes: int  # deducted for the model weights
    overhead_bytes: int  # deducted for activations, CUDA graphs, the allocator
    margin: float  # the fraction of what is left kept free
    kv_bytes: int  # (memory - weights - overhead) x (1 - margin), floored
    num_gpu_blocks: int  # kv_bytes // block bytes: the pool size, null block included

    def describe(self) -> list[str]:
        """The computation, one line per term."""
        layout = self.layout
        left = self.memory_bytes - self.weights_bytes - self.overhead_bytes
        return [
            f"memory        {format_size(self.memory_bytes):>12}  ({self.memory_source})",
            f"- weights     {format_size(self.weights_bytes):>12}",
            f"- overhead    {format_size(self.overhead_bytes):>12}",
            f"= available   {format_size(left):>12}",
            f"x (1 - {self.margin:g})   {format_size(self.kv_bytes):>12}  for the KV cache",
            f"block bytes   {format_size(layout.block_bytes):>12}  = 2 x {layout.num_layers} layers x "
            f"{layout.num_kv_heads} kv_heads x {layout.head_dim} head_dim x {layout.block_size} tokens x "
            f"{layout.dtype_size} B ({layout.dtype})",
            f"num_gpu_blocks {self.num_gpu_blocks}  ({self.num_gpu_blocks * layout.block_size} tokens, "
            "block 0 is the null block)",
        ]


def plan_capacity(
    layout: KVLayout,
    memory_bytes: int,
    weights_bytes: int = 0,
    overhead_bytes: int = 0,
    margin: float = DEFAULT_MARGIN,
    memory_source: str = "--gpu-mem",
) -> CapacityPlan:
    """How many blocks of `layout` fit in `memory_bytes` after the deductions.

    Raises:
        InvalidRequest: a size is negative or not an integer, memory is 0, the margin is not in
            [0, 1), nothing is left after weights and overhead, or fewer than two blocks fit.

    >>> plan_capacity(KVLayout(32, 8, 128, 16), 141 * 2**30).num_gpu_blocks
    57753
    >>> plan_capacity(KVLayout(32, 8, 128, 16), 141 * 2**30, 16 * 2**30, 2 * 2**30).num_gpu_blocks
    50380
    """
    for name, value in (("gpu_mem", memory_bytes), ("weights", weights_bytes), ("overhead", overhead_bytes)):
        if not is_int(value) or value < 0:
            raise InvalidRequest(f"{name} must be a non-negative number of bytes; got {name}={value!r}")
    if memory_bytes == 0:
        raise InvalidRequest("gpu_mem=0 bytes: there is no memory to size a KV cache in")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise InvalidRequest(f"margin must be a fraction in [0, 1); got margin={margin!r}")
    available = memory_bytes - weights_bytes - overhead_bytes
    if available <= 0:
        raise InvalidRequest(
            f"no memory left for the KV cache: gpu_mem={format_size(memory_bytes)} - weights="
            f"{format_size(weights_bytes)} - overhead={format_size(overhead_bytes)} = {format_size(available)}"
        )
    # Fraction(str(margin)) reads 0.2 as 1/5, not as the binary float nearest it.
    kv_bytes = int(available * (1 - Fraction(str(margin))))
    num_gpu_blocks = kv_bytes // layout.block_bytes
    if num_gpu_blocks < 2:
        raise InvalidRequest(
            f"only {num_gpu_blocks} blocks of {format_size(layout.block_bytes)} fit in "
            f"{format_size(kv_bytes)} (gpu_mem={format_size(memory_bytes)}, margin={margin:g}); a pool needs "
            "the null block and at least one usable block"
        )
    return CapacityPlan(
        layout=layout,
        memory_bytes=memory_bytes,
        memory_source=memory_source,
        weights_bytes=weights_bytes,
        overhead_bytes=overhead_bytes,
        margin=float(margin),
        kv_bytes=kv_bytes,
        num_gpu_blocks=num_gpu_blocks,
    )


def device_free_memory(device: str | None = None) -> tuple[int, str]:
    """The free memory of a CUDA device, in bytes, and a label naming the device.

    Raises:
        InvalidRequest: the device picked is not a CUDA device (the CPU has no memory budget to read).
    """
    import torch  # here, not at module level: the arithmetic above needs no torch

    # optional dependency (the gpu extra): torch is imported only when a device is asked for
    from kvspec.gpu_impl.device import pick_device

    dev = pick_device(device)
    if dev.type != "cuda":
        raise InvalidRequest(
            f"no CUDA device to read free memory from (device={dev}); pass gpu_mem, e.g. --gpu-mem 141GiB"
        )
    free, _total = torch.cuda.mem_get_info(dev)
    return int(free), f"free memory of {dev}"
