"""`kvspec capacity`: how many KV blocks fit on a GPU (seed 002's sizing rule, gpu_impl.sizing).

    kvspec capacity --gpu-mem 141GiB --layers 32 --kv-heads 8 --head-dim 128 --dtype bf16 --block-size 16
    kvspec capacity --layers 32 --kv-heads 8 --head-dim 128 --device cuda:0   # the device's free memory

Prints the computation term by term and the block count. Exit 0, or 2 with
the reason on stderr for a bad size (or no `--gpu-mem` and no CUDA device).
`kvspec bench gpu` (gpu_impl against the reference) is `kvspec bench`'s.
Nothing here imports torch unless the free memory must be read from a device.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from kvspec.conformance.core.results import EXIT_COULD_NOT_RUN, EXIT_OK
from kvspec.conformance.tools.commands._arguments import (
    fraction,
    json_output,
    memory_size,
    positive_int,
    text_for_people,
)
from kvspec.conformance.tools.commands._check_output import write_json
from kvspec.gpu_impl.sizing import DEFAULT_MARGIN, DTYPE_SIZES, KVLayout, parse_size, plan_capacity
from kvspec.spec.errors import BlockManagerError


def register(subparsers: Any) -> None:
    """Add the `capacity` subcommand."""
    p = subparsers.add_parser(
        "capacity",
        help="how many KV blocks fit in GPU memory: (mem - weights - overhead) x (1 - margin) / block bytes",
        description=(__doc__ or "").splitlines()[0],
        epilog="exit codes: 0 the sizing printed; 2 no answer: a bad size or flag, not one block fits, "
        "no --gpu-mem and no CUDA device, or a --json that cannot be written",
    )
    p.add_argument(
        "--gpu-mem",
        type=memory_size,
        help="memory budget, e.g. 141GiB or 80GB (default: free memory of the CUDA device)",
    )
    p.add_argument("--layers", type=positive_int, required=True, help="attention layers with a KV cache")
    p.add_argument("--kv-heads", type=positive_int, required=True, help="KV heads per layer")
    p.add_argument("--head-dim", type=positive_int, required=True, help="elements per head")
    p.add_argument(
        "--dtype", default="bf16", help=f"KV cache dtype (default bf16; one of {', '.join(sorted(DTYPE_SIZES))})"
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default 16)")
    p.add_argument("--weights", type=memory_size, default=0, help="memory taken by the model weights (default 0)")
    p.add_argument(
        "--overhead", type=memory_size, default=0, help="runtime overhead: activations, CUDA graphs (default 0)"
    )
    p.add_argument("--margin", type=fraction, default=DEFAULT_MARGIN, help="fraction kept free (default 0.2)")
    p.add_argument("--device", default=None, help="the CUDA device whose free memory is read (no --gpu-mem)")
    p.add_argument("--json", type=json_output, metavar="PATH", help="also write the sizing as JSON (- for stdout)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the sizing; exit 2 on a bad size."""
    if args.gpu_mem is not None and args.device is not None:
        # --device names where the free memory is read; with --gpu-mem nothing is read, and the device would be
        # silently ignored
        print("kvspec capacity: --gpu-mem gives the memory and --device reads it from a device; give one",
              file=sys.stderr)  # fmt: skip
        return EXIT_COULD_NOT_RUN
    try:
        layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.block_size, args.dtype)
        weights = parse_size(args.weights, "weights")
        overhead = parse_size(args.overhead, "overhead")
        if args.gpu_mem is not None:
            memory, source = parse_size(args.gpu_mem, "gpu_mem"), "--gpu-mem"
        else:
            from kvspec.gpu_impl.sizing import device_free_memory  # reads the device: imports torch

            memory, source = device_free_memory(args.device)
        plan = plan_capacity(layout, memory, weights, overhead, args.margin, source)
    except BlockManagerError as e:
        print(f"kvspec capacity: {e}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    with text_for_people(args.json):
        print("\n".join(plan.describe()))
    if args.json is not None:
        return write_json({"kvspec": "capacity", **dataclasses.asdict(plan)}, args.json, prog="kvspec capacity")
    return EXIT_OK
