"""What a plugin module sees inside an overlay: vllm by importlib too, and a placeholder for its device module."""

import importlib

from tailfree import device

block_pool = importlib.import_module("vllm.v1.core.block_pool")
ALLOCATOR = device.allocator_name()
