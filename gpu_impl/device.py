"""Where gpu_impl keeps its tensors: the one function that picks the device.

CUDA when present, the CPU otherwise, so the same pool runs (and is checked)
on a laptop, in CI without a GPU, and on a GPU server. An explicit device
always wins; the environment variable `KVSPEC_DEVICE` is the override for
runs that cannot pass one (the device check script forces `cpu` with it).
"""

from __future__ import annotations

import os

import torch

from kvspec.spec.errors import InvalidRequest

__all__ = ["DEVICE_ENV_VAR", "cuda_available", "device_problem", "pick_device"]

DEVICE_ENV_VAR = "KVSPEC_DEVICE"


def cuda_available() -> bool:
    """Whether a CUDA device can be used by this process."""
    return bool(torch.cuda.is_available())


def pick_device(requested: str | torch.device | None = None) -> torch.device:
    """The device gpu_impl puts a pool on.

    Precedence: `requested`, then `$KVSPEC_DEVICE`, then `cuda` when CUDA is
    available, else `cpu`.

    Args:
        requested: a torch device or its name ("cpu", "cuda", "cuda:1"), or None to pick.

    Returns:
        The device, with an index for CUDA (so two pools compare equal devices).

    Raises:
        InvalidRequest: the name is not a device torch knows, or names CUDA where there is none,
            or a CUDA index this machine does not have.
    """
    source = "device"
    if requested is None:
        env = os.environ.get(DEVICE_ENV_VAR, "").strip()
        if env:
            requested, source = env, DEVICE_ENV_VAR
    if requested is None:
        return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as e:
        raise InvalidRequest(f"{source}={requested!r} is not a device name torch knows ({e})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise InvalidRequest(f"{source}={requested!r}: gpu_impl runs on 'cpu' or 'cuda[:index]' only")
    if not cuda_available():
        raise InvalidRequest(f"{source}={requested!r} but this machine has no usable CUDA device; use 'cpu'")
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        raise InvalidRequest(f"{source}={requested!r} but this machine has {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", index)


def device_problem(name: str) -> str | None:
    """Why a device named `name` does not exist on this machine, or None (it exists, or it is not torch's).

    Asked before a run starts (`kvspec check --device`), so that `cuda:99` is refused in one line rather
    than by every adapter built. Only CUDA is judged: a name torch does not parse is some other
    runtime's (an accelerator plugin's), left to the adapter that takes it.

    >>> device_problem("cpu") is None
    True
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        return None
    if device.type != "cuda":
        return None
    try:
        pick_device(name)
    except InvalidRequest as e:
        return str(e)
    return None
