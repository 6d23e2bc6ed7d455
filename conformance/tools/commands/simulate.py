"""`kvspec simulate`: replay a workload through the reference under profiles x block sizes x pool sizes.

Prints, per configuration, the prefix-cache hit rate as vLLM's statistics
count it, evictions, preemptions, the peak of blocks held and the share of
held slots left unfilled in request tails (kvspec.conformance.tools.simulate). The
workload is a built-in family (kvspec.conformance.tools.workloads: chat, rag,
few-shot, none; each seeded) or a JSON-lines file, one request per line:
{"prompt": [token ids], "output": [token ids], "arrival": step, "lora": name,
"cache_salt": salt}, every field but "prompt" optional. Configurations run in
parallel, one process per core.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvspec.conformance.tools.commands._arguments import (
    json_output,
    non_negative_int,
    output_file,
    positive_int,
    profile_name,
    text_for_people,
    write_output,
)
from kvspec.conformance.tools.commands._check_output import write_json
from kvspec.conformance.tools.simulate import WorkloadError, pool_size_refusal, read_workload, simulate
from kvspec.conformance.tools.workloads import WORKLOADS, builtin_workload

__all__ = ["register", "run"]

_COLUMNS = ("profile", "block", "pool", "hit rate", "hits / queries", "evictions", "preempted", "peak held", "tails")


def register(subparsers: Any) -> None:
    """Add the `simulate` subcommand."""

    p = subparsers.add_parser(
        "simulate",
        help="measure hit rate, evictions and fragmentation of a workload per profile, block size and pool size",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="built-in workloads: "
        + " ".join(f"{f.name}: {f.description}" for f in WORKLOADS.values())
        + ". Exit codes: 0 the table printed; 2 a workload, pool or output that cannot be used, or a workload no "
        "pool measured (every request larger than every pool).",
    )
    p.add_argument("--workload", default="chat", help=f"{', '.join(WORKLOADS)}, or a .jsonl file (default chat)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="a built-in workload's seed (default 0)")
    p.add_argument(
        "--block-size", type=positive_int, nargs="+", default=[16], metavar="N", help="tokens per block (default 16)"
    )
    p.add_argument(
        "--pool",
        type=_pool_size,
        nargs="+",
        default=[2000],
        metavar="N",
        help="blocks in the pool, the null block included (default 2000, at least 2)",
    )
    p.add_argument(
        "--profile",
        type=profile_name,
        nargs="+",
        default=["vllm-v1"],
        metavar="P",
        help="ordering profiles (default vllm-v1)",
    )
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    p.add_argument("--plot", type=output_file, metavar="PNG", help="write hit rate against pool capacity (matplotlib)")
    p.add_argument("--json", type=json_output, metavar="PATH", help="also write the results as JSON (- for stdout)")
    p.set_defaults(run=run)


def _pool_size(text: str) -> int:
    """Blocks in a pool: the null block and at least one a request can hold (a pool of 1 rejects every request,
    and its table of zeros would read as a measurement)."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, the null block and one block to allocate; got {value}")
    return value


def _one(job: tuple[Any, int, int, str]) -> Any:

    workload, block_size, pool, profile = job
    return simulate(workload, block_size=block_size, num_gpu_blocks=pool, profile=profile)


def _load(name: str, seed: int) -> Any:

    if name in WORKLOADS:
        return builtin_workload(name, seed)
    if not name or not Path(name).exists():  # Path("") is the current folder, which exists
        built_in = ", ".join(WORKLOADS)
        raise FileNotFoundError(f"--workload {name!r} is neither a built-in workload ({built_in}) nor a file")
    return read_workload(name)


def _row(r: Any) -> tuple[str, ...]:
    evictions = "-" if r.evictions is None else str(r.evictions)
    # no query, no rate: 0 / 0 printed as 0.0% would read as a pool that never hits
    hit_rate = f"{r.hit_rate:.1%}" if r.queries else "-"
    return (r.profile, str(r.block_size), str(r.num_gpu_blocks), hit_rate, f"{r.hits} / {r.queries}",
            evictions, str(r.preemptions), str(r.peak_blocks_held), f"{r.tail_share:.1%}")  # fmt: skip


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def plot(results: list[Any], title: str) -> bytes:
    """Hit rate against pool capacity in tokens, one line per profile and block size: a PNG's bytes.

    Capacity in tokens (blocks x block size), not blocks: a 64-token block
    costs four 16-token ones, so block sizes are compared at equal memory.

    Raises:
        ImportError: matplotlib is not installed (the `plot` extra).
    """
    # optional dependency (the plot extra): only --plot draws
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    # optional dependency (the plot extra): only --plot draws
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r.profile, r.block_size) for r in results}):
        mine = [r for r in results if (r.profile, r.block_size) == key]
        line = sorted((r.num_gpu_blocks * r.block_size, r.hit_rate) for r in mine)
        ax.plot([p for p, _ in line], [100 * h for _, h in line], marker="o", label=f"{key[0]}, block {key[1]}")
    ax.set_xscale("log")
    ax.set_xlabel("pool capacity (tokens: blocks x block size)")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()


def run(args: argparse.Namespace) -> int:
    """Run every configuration; 0, or 2 for a workload or an output that cannot be used."""
    configurations = len(args.profile) * len(args.block_size) * len(args.pool)
    refusal = pool_size_refusal(args.pool, min(args.jobs, configurations))
    if refusal:
        print(f"kvspec simulate: {refusal}", file=sys.stderr)
        return 2
    try:
        workload = _load(args.workload, args.seed)
    except (WorkloadError, FileNotFoundError) as e:
        print(f"kvspec simulate: {e}", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvspec simulate: --plot needs matplotlib: pip install 'kvspec[plot]'", file=sys.stderr)
            return 2
    jobs = [(workload, b, p, prof) for prof in args.profile for b in args.block_size for p in args.pool]
    try:
        if args.jobs > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(min(args.jobs, len(jobs))) as pool:
                results = list(pool.map(_one, jobs))
        else:
            results = [_one(job) for job in jobs]
    except WorkloadError as e:  # one that did not finish: preemptions that go on past the steps a run has
        print(f"kvspec simulate: {args.workload}: {e}", file=sys.stderr)
        return 2

    source = f"{args.workload} (seed {args.seed})" if args.workload in WORKLOADS else args.workload
    if all(r.rejected == r.requests for r in results):
        # every configuration rejected every request: its table would be rows of zeros that measured nothing
        print(f"kvspec simulate: every request of {source} is larger than every pool even alone, so nothing was "
              f"measured; give a larger --pool (largest {max(args.pool):,} blocks)", file=sys.stderr)  # fmt: skip
        return 2
    with text_for_people(args.json):
        print(f"workload: {source}, {len(workload)} requests")
        print(_table([_row(r) for r in results]))
        for r in results:
            if r.rejected:
                print(f"{r.profile}, block {r.block_size}, pool {r.num_gpu_blocks}: {r.rejected} request(s) "
                      "rejected, larger than the pool even alone (not in the counts)")  # fmt: skip
        if args.plot is not None:
            if write_output("kvspec simulate", args.plot, plot(results, f"kvspec simulate: {source}")):
                return 2
            print(f"plot: {args.plot}")
    if args.json is not None:
        document = {"workload": source, "requests": len(workload), "results": [r.as_json() for r in results]}
        return write_json(document, args.json, prog="kvspec simulate")
    return 0
