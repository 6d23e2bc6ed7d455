"""kvcached's device layer, as the overlay's placeholders: the C++ page allocator and the GPU set-up, in Python.

kvcached's ``ElasticBlockPool`` gets its block ids from kvcached's own
``KVCacheManager`` (kvcached/kv_cache_manager.py, run as shipped), which
takes them from a C++ extension, ``kvcached.vmm_ops``: ``PageAllocator``
hands out pages of GPU virtual memory and ``InternalPage`` hands out the
blocks of one page. The C++ code also maps physical memory (cuMemMap) and
talks to worker processes. Only the id bookkeeping is observable by the
pool; these classes copy it line for line from csrc/page_allocator.cpp
(kvcached 0.1.6) and leave out the mapping.

- `InternalPage`: a FIFO free list per page. ``init`` fills it with the
  page's block range in id order, ``alloc(n)`` takes the first n, ``free``
  and ``free_batch`` append: the same ids in the same order as the C++.
- `PageAllocator`: pages come from the reserved list first, then from the
  free list, front first; ``free_pages`` refills the reserved list up to
  ``KVCACHED_MAX_RESERVED_PAGES`` and appends the rest to the free list, as
  the C++ does. Left out, with why the ids are unchanged: mapping and
  unmapping (no id depends on them); the pre-allocation thread (it only maps
  pages ahead of use, and with it off, ``enable_page_prealloc=False``, the
  C++ takes pages in this same order); physical memory (the device is taken
  to hold the whole pool: ``get_avail_physical_pages`` is every page, so no
  allocation fails for want of memory); resizing (no memory limit is set:
  ``get_resize_target`` is -1, the C++ initial value). ``group_indices_by_page``
  returns a dict in first-seen order where the C++ returns an
  ``unordered_map``; the order matters only when one call frees blocks on
  several pages, and the overlay builds every pool on one page.
- the operations on GPU memory (``map_to_kv_tensors`` and the others) raise
  if called; the single-process pool never calls them.
- ``kv_tensors_created``: True. The C++ answers whether the worker created
  the KV tensors; the manager waits for that before reserving block 0 as the
  null block, which it then does exactly as in production.
- `interfaces_module`: ``kvcached.integration.vllm.interfaces`` creates the
  GPU tensors and talks to the workers; of it the pool uses
  ``get_kv_cache_manager``, copied here without the tensor-capacity
  records of a worker process (the engine process keeps none either), and
  ``should_use_worker_ipc``, False: the manager then checks tensor creation
  in-process instead of over a socket, the same answer.
"""

from __future__ import annotations

import os
import types
from collections import deque
from typing import Any

__all__ = ["InternalPage", "PageAllocator", "interfaces_module", "vmm_ops_module"]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


class InternalPage:
    """One page's blocks: a FIFO free list, as csrc/page_allocator.cpp's ``InternalPage``."""

    def __init__(self, page_id: int, page_size: int) -> None:
        self.page_id = page_id  # the page's index in the pool's virtual memory
        self.page_size = page_size  # bytes
        self.start_block = 0  # first block id wholly inside the page
        self.end_block = 0  # one past the last
        self.num_kv_blocks = 0
        self.free_list: list[int] = []  # free block ids, taken from the front

    def init(self, block_mem_size: int) -> None:
        """Fill the free list with the page's block range, in id order."""
        self.start_block, self.end_block = self.get_block_range(self.page_id, self.page_size, block_mem_size)
        self.num_kv_blocks = self.end_block - self.start_block
        self.free_list = list(range(self.start_block, self.end_block))

    def alloc(self, num_blocks: int = 1) -> list[int]:
        """The first ``num_blocks`` free ids, taken off the list.

        Raises:
            RuntimeError: fewer are free (the C++'s ``std::runtime_error``).
        """
        if len(self.free_list) < num_blocks:
            raise RuntimeError("Not enough free blocks in page")
        taken, self.free_list = self.free_list[:num_blocks], self.free_list[num_blocks:]
        return taken

    def free(self, block_id: int) -> None:
        """Append one id to the free list."""
        self.free_list.append(block_id)

    def free_batch(self, block_ids: list[int]) -> None:
        """Append ids to the free list, in the order given."""
        self.free_list.extend(block_ids)

    def empty(self) -> bool:
        """Every block of the page is free."""
        return len(self.free_list) == self.num_kv_blocks

    def full(self) -> bool:
        """No block of the page is free."""
        return not self.free_list

    def num_free_blocks(self) -> int:
        """How many blocks of the page are free."""
        return len(self.free_list)

    def get_free_blocks(self) -> list[int]:
        """The free ids, in the order they are taken."""
        return list(self.free_list)

    @staticmethod
    def get_block_range(page_id: int, page_size: int, block_mem_size: int) -> tuple[int, int]:
        """The ids of the blocks wholly inside a page (a block straddling a boundary belongs to neither)."""
        start = (page_id * page_size + block_mem_size - 1) // block_mem_size
        return start, ((page_id + 1) * page_size) // block_mem_size

    @staticmethod
    def get_num_blocks(page_size: int, block_mem_size: int) -> int:
        """Blocks per page, rounded down."""
        return page_size // block_mem_size


class PageAllocator:
    """Pages of one pool: a reserved list and a free list, taken front first, as the C++ ``PageAllocator``."""

    def __init__(
        self,
        num_layers: int,
        mem_size_per_layer: int,
        page_size: int,
        world_size: int = 1,
        pp_rank: int = 0,
        async_sched: bool = False,
        contiguous_layout: bool = True,
        enable_page_prealloc: bool = True,
        num_kv_buffers: int = 2,
        group_id: int = 0,
        ipc_name: str = "",
    ) -> None:
        self.page_size = page_size
        self.num_total_pages = mem_size_per_layer // page_size
        self.num_free_pages = self.num_total_pages  # pages not handed out (reserved ones included)
        self.free_page_list: deque[int] = deque(range(self.num_total_pages))  # unmapped pages
        self.reserved_page_list: deque[int] = deque()  # mapped pages kept for reuse
        self.max_reserved_pages = min(self.num_total_pages, _env_int("KVCACHED_MAX_RESERVED_PAGES", 10))

    def alloc_page(self) -> InternalPage:
        """The next page: the reserved list's front, else the free list's.

        Raises:
            RuntimeError: no page is left (the C++ message).
        """
        if self.reserved_page_list:
            page_id = self.reserved_page_list.popleft()
        elif self.free_page_list:
            page_id = self.free_page_list.popleft()
        else:
            raise RuntimeError("No free pages left")
        self.num_free_pages -= 1
        return InternalPage(page_id, self.page_size)

    def free_page(self, page_id: int) -> None:
        """Give one page back: to the reserved list while it has room, else to the free list."""
        self.free_pages([page_id])

    def free_pages(self, page_ids: list[int]) -> None:
        """Give pages back: the first ones refill the reserved list, the rest go to the free list."""
        self.num_free_pages += len(page_ids)
        room = max(self.max_reserved_pages - len(self.reserved_page_list), 0)
        self.reserved_page_list.extend(page_ids[:room])
        self.free_page_list.extend(page_ids[room:])

    def get_num_free_pages(self) -> int:
        """Pages not handed out."""
        return self.num_free_pages

    def get_num_inuse_pages(self) -> int:
        """Pages handed out."""
        return self.num_total_pages - self.num_free_pages

    def get_num_total_pages(self) -> int:
        """Pages of the pool."""
        return self.num_total_pages

    def get_num_reserved_pages(self) -> int:
        """Mapped pages kept for reuse."""
        return len(self.reserved_page_list)

    def get_avail_physical_pages(self) -> int:
        """Pages physical memory could still back: all of them (the device holds the whole pool)."""
        return self.num_total_pages

    def get_resize_target(self) -> int:
        """-1: no memory limit asks for a resize (the C++ initial value)."""
        return -1

    def get_page_id(self, block_id: int, block_mem_size: int) -> int:
        """The page a block lies on."""
        return block_id * block_mem_size // self.page_size

    def group_indices_by_page(self, indices: list[int], block_mem_size: int) -> dict[int, list[int]]:
        """Block ids grouped by page, each group in the order given."""
        groups: dict[int, list[int]] = {}
        for idx in indices:
            groups.setdefault(self.get_page_id(idx, block_mem_size), []).append(idx)
        return groups

    def reset_free_page_order(self) -> None:
        """Sort the free list, as the C++ does."""
        self.free_page_list = deque(sorted(self.free_page_list))

    def start_prealloc_thread(self) -> None:
        """Nothing: pages are taken on demand (see the module docstring)."""

    def stop_prealloc_thread(self) -> None:
        """Nothing to stop."""

    def set_use_worker_ipc(self, use_worker_ipc: bool) -> None:
        """Nothing: no worker process is reached."""

    def set_broadcast_map_callback(self, callback: Any) -> None:
        """Nothing: mapping is left out."""

    def set_broadcast_unmap_callback(self, callback: Any) -> None:
        """Nothing: mapping is left out."""

    def release_shared_segment(self) -> bool:
        """Nothing to release: no shared-memory segment is made."""
        return True

    def trim(self) -> None:
        """Nothing: no reserved page holds physical memory here."""


def _kv_tensors_created(group_id: int = 0) -> bool:
    return True


# The extension's operations on GPU memory. The single-process pool never calls
# them (tp_ipc_util binds them at import); one that is reached says so.
_DEVICE_OPS = (
    "init_kvcached", "shutdown_kvcached", "create_kv_tensors", "map_to_kv_tensors", "unmap_from_kv_tensors",
    "map_to_kv_tensors_with_result", "prepare_unmap_from_kv_tensors", "commit_unmap_from_kv_tensors",
    "abort_unmap_from_kv_tensors",
)  # fmt: skip


def _device_op(name: str) -> Any:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"kvcached.vmm_ops.{name}: GPU memory operations are left out of the overlay")

    op.__name__ = name
    return op


def vmm_ops_module(overlay: Any) -> types.ModuleType:
    """A fresh ``kvcached.vmm_ops``: the classes above and ``kv_tensors_created`` (True)."""
    module = types.ModuleType("kvcached.vmm_ops", __doc__)
    module.__dict__.update(
        PageAllocator=PageAllocator, InternalPage=InternalPage, kv_tensors_created=_kv_tensors_created
    )
    module.__dict__.update({name: _device_op(name) for name in _DEVICE_OPS})
    return module


def interfaces_module(overlay: Any) -> types.ModuleType:
    """A fresh ``kvcached.integration.vllm.interfaces``: ``get_kv_cache_manager`` and ``should_use_worker_ipc``."""
    module = types.ModuleType("kvcached.integration.vllm.interfaces", __doc__)

    def get_kv_cache_manager(
        num_blocks: int,
        block_size: int,
        cell_size: int,
        num_layers: int,
        num_kv_buffers: int = 2,
        group_id: int = 0,
        pool_name: str | None = None,
    ) -> Any:
        manager_mod = overlay.import_plugin("kvcached.kv_cache_manager")
        registry = overlay.import_plugin("kvcached.pool_registry")
        # as the real function in a single-process engine: world size 1, rank 0, synchronous scheduling
        manager = manager_mod.KVCacheManager(
            num_blocks, block_size, cell_size, num_layers, 1, pp_rank=0, async_sched=False,
            num_kv_buffers=num_kv_buffers, group_id=group_id, reserve_null_block=True,
            pool_name=pool_name, defer_physical_release=False,
        )  # fmt: skip
        registry.register_kv_cache_pool(manager, integration="vllm")
        return manager

    module.__dict__.update(get_kv_cache_manager=get_kv_cache_manager, should_use_worker_ipc=lambda: False)
    return module
