"""A miniature vllm/utils: the one name v0's block code imports from it, next to a heavy import light mode skips."""

import enum

import torch  # noqa: F401  (never run: light mode executes only the definitions v0 asks for)


class Device(enum.Enum):
    GPU = enum.auto()
    CPU = enum.auto()
