"""A plugin in the style of vLLM plugins: importing it replaces vLLM's free_blocks (every freed block to the right)."""

from vllm.v1.core.block_pool import BlockPool

try:
    import torch  # noqa: F401  (a device runtime: never importable inside an overlay)

    HAS_DEVICE = True
except ImportError:
    HAS_DEVICE = False


def free_blocks(self: BlockPool, ordered_blocks: list) -> None:
    freed = []
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0 and not block.is_null:
            freed.append(block)
    self.free_block_queue.append_n(freed)  # in the order given, hashed or not


BlockPool.free_blocks = free_blocks
