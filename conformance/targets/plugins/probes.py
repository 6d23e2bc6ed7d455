"""Each plugin's directed probes: the shortest scenario that shows each known divergence, and what conforms.

A probe is written so that its first failing check is the divergence it is
named after (on a 4-block pool, block size 4, unless it says otherwise).
Some probes are expected to conform: they show which part of vLLM's
behaviour a plugin keeps (kvcached's LRU eviction of cached blocks).
"""

from __future__ import annotations

from kvspec.conformance.targets.plugins.findings import PluginProbe
from kvspec.spec.manager import Request

__all__ = ["ASCEND_PROBES", "KVCACHED_PROBES", "MLX_POOL_PROBES", "MLX_REQUEST_PROBES", "TPU_PROBES"]


def _h(n: int) -> bytes:
    return bytes([0xA0 + n]) * 4


def _admit(request: Request) -> tuple[tuple[str, tuple[object, ...]], ...]:
    """A new request's lookup, then one allocation for all its tokens (no hit)."""
    return (
        ("get_computed_blocks", (request,)),
        ("allocate_slots", (request, len(request.token_ids), 0, [], 0)),
    )


_DOUBLE_FREE = (("get_new_blocks", (1,)), ("free_blocks", ([1],)), ("free_blocks", ([1],)))
_NAMED_TWICE = (("get_new_blocks", (2,)), ("free_blocks", ([1, 1],)))
_REGISTERED_AGAIN = (
    ("get_new_blocks", (1,)),
    ("cache_full_blocks", ([1], [_h(1)])),
    ("cache_full_blocks", ([1], [_h(2)])),
)

MLX_POOL_PROBES: tuple[PluginProbe, ...] = (
    PluginProbe("double free", _DOUBLE_FREE),
    PluginProbe("null block touched", (("touch", ([0],)),)),
    PluginProbe("null block freed", (("free_blocks", ([0],)),)),
    PluginProbe("cached block registered again", _REGISTERED_AGAIN),
    PluginProbe("reset refused while a block is held", (("get_new_blocks", (1,)), ("reset_prefix_cache", ()))),
)

_A = Request("a", tuple(range(1, 9)))
_B_SAME_TAIL = Request("b", (9, 9, 9, 9, 5, 6, 7, 8))  # its second block's tokens are a's, after another prefix
_SHORT = Request("s", (1, 2, 3, 4))
_LORA_A = Request("la", tuple(range(1, 9)), lora_name="lora-a")
_LORA_B = Request("lb", tuple(range(1, 10)), lora_name="lora-b")
_FIRST = Request("f", (1, 2, 3, 4))
_OTHER = Request("o", (5, 6, 7, 8, 9, 10, 11, 12))
_AGAIN = Request("g", (1, 2, 3, 4, 99))
_LONG = Request("l", tuple(range(1, 13)))

MLX_REQUEST_PROBES: tuple[PluginProbe, ...] = (
    PluginProbe(
        "a block reused after another prefix",
        (*_admit(_A), *_admit(_B_SAME_TAIL)),
        level="manager",
        num_gpu_blocks=8,
    ),
    PluginProbe(
        "a freed block's old key still hits",
        (*_admit(_FIRST), ("free", ("f",)), *_admit(_OTHER), ("get_computed_blocks", (_AGAIN,))),
        level="manager",
        num_gpu_blocks=3,
    ),
    PluginProbe(
        "a hit across LoRA adapters",
        (*_admit(_LORA_A), ("get_computed_blocks", (_LORA_B,))),
        level="manager",
        num_gpu_blocks=8,
    ),
    PluginProbe(
        "a hit covers the whole prompt",
        (*_admit(_SHORT), ("get_computed_blocks", (Request("s2", (1, 2, 3, 4)),))),
        level="manager",
        num_gpu_blocks=8,
    ),
    PluginProbe(
        "part of an allocation when blocks run out",
        (("get_computed_blocks", (_LONG,)), ("allocate_slots", (_LONG, 12, 0, [], 0))),
        level="manager",
        num_gpu_blocks=3,
    ),
    PluginProbe("a request freed head first", (*_admit(_A), ("free", ("a",))), level="manager", num_gpu_blocks=8),
    PluginProbe(
        "hashes registered with caching off",
        _admit(_SHORT),
        level="manager",
        caching=False,
        num_gpu_blocks=8,
    ),
)

KVCACHED_PROBES: tuple[PluginProbe, ...] = (
    PluginProbe(
        "a block without a hash reused oldest-freed first", (("get_new_blocks", (1,)), ("free_blocks", ([1],)))
    ),
    PluginProbe("usage counts the null block", (("get_new_blocks", (1,)), ("get_usage", ()))),
    PluginProbe(
        "cached blocks evicted least recently freed first",
        (
            ("get_new_blocks", (3,)),
            ("cache_full_blocks", ([1, 2, 3], [_h(1), _h(2), _h(3)])),
            ("free_blocks", ([3, 2, 1],)),
            ("touch", ([3],)),
            ("free_blocks", ([3],)),
            ("get_new_blocks", (2,)),
        ),
    ),
    PluginProbe(
        "reset accepted while a block is held",
        (("get_new_blocks", (1,)), ("cache_full_blocks", ([1], [_h(1)])), ("reset_prefix_cache", ())),
    ),
    PluginProbe(
        "reset accepted while a block is held, caching off",
        (("get_new_blocks", (1,)), ("reset_prefix_cache", ())),
        caching=False,
    ),
    PluginProbe(
        "a freed block keeps its ref_cnt, caching off",
        (("get_new_blocks", (1,)), ("free_blocks", ([1],))),
        caching=False,
        num_gpu_blocks=2,
    ),  # fmt: skip
    PluginProbe("cached block registered again", _REGISTERED_AGAIN),
)

TPU_PROBES: tuple[PluginProbe, ...] = (
    PluginProbe("free_blocks raises", (("get_new_blocks", (1,)), ("free_blocks", ([1],))), num_gpu_blocks=2),
    PluginProbe("one block taken from the top", (("get_new_blocks", (1,)),)),
    PluginProbe("a run of blocks taken lowest first", (("get_new_blocks", (2,)),)),
)

ASCEND_PROBES: tuple[PluginProbe, ...] = (
    PluginProbe("double free dropped with a warning", _DOUBLE_FREE, ignored_as=_DOUBLE_FREE[:2]),
    PluginProbe(
        "a block named twice in one free dropped with a warning",
        _NAMED_TWICE,
        ignored_as=(("get_new_blocks", (2,)), ("free_blocks", ([1],))),
    ),
    PluginProbe("null block freed", (("free_blocks", ([0],)),)),
    PluginProbe("cached block registered again", _REGISTERED_AGAIN),
)
