"""Sizing (seed 002): the block count from device memory, and `kvspec capacity`."""

from __future__ import annotations

import pytest

from kvspec.conformance.tools.cli import main
from kvspec.gpu_impl.device import cuda_available
from kvspec.gpu_impl.sizing import KVLayout, device_free_memory, format_size, parse_size, plan_capacity
from kvspec.spec.errors import InvalidRequest

GIB = 2**30
LLAMA_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bf16")


def test_block_bytes_is_k_and_v_of_every_layer_head_and_token():
    assert LLAMA_8B.block_bytes == 2 * 32 * 8 * 128 * 16 * 2 == 2 * 2**20
    assert KVLayout(1, 1, 1, 1, "fp8").block_bytes == 2
    assert KVLayout(1, 1, 1, 1, "fp32").block_bytes == 8


def test_the_issue_example_and_its_deductions():
    assert plan_capacity(LLAMA_8B, 141 * GIB).num_gpu_blocks == 57753  # 141 GiB x 0.8 / 2 MiB
    plan = plan_capacity(LLAMA_8B, 141 * GIB, weights_bytes=16 * GIB, overhead_bytes=2 * GIB)
    assert plan.num_gpu_blocks == 50380  # 123 GiB x 0.8 / 2 MiB
    assert plan.kv_bytes == int(123 * GIB * 0.8)
    assert plan_capacity(LLAMA_8B, 141 * GIB, margin=0).num_gpu_blocks == 141 * 512


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("141GiB", 141 * GIB),
        ("16GB", 16 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        ("4096", 4096),
        ("2 gib", 2 * GIB),
        (1234, 1234),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["14xGiB", "GiB", "-1GiB", "1e9", ""])
def test_unreadable_sizes_are_refused(text):
    with pytest.raises(InvalidRequest, match=r"^cannot read size=.*expected a number and a unit"):
        parse_size(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"memory_bytes": 10 * GIB, "weights_bytes": 16 * GIB},
            r"^no memory left for the KV cache: gpu_mem=10\.00 GiB",
        ),
        ({"memory_bytes": 0}, r"^gpu_mem=0 bytes: there is no memory"),
        ({"memory_bytes": GIB, "margin": 1.0}, r"^margin must be a fraction in \[0, 1\); got margin=1\.0$"),
        ({"memory_bytes": GIB, "margin": -0.1}, r"^margin must be a fraction in \[0, 1\)"),
        ({"memory_bytes": 2 * 2**20}, r"^only 0 blocks of 2\.00 MiB fit in 1\.60 MiB"),
        ({"memory_bytes": -5}, r"^gpu_mem must be a non-negative number of bytes; got gpu_mem=-5$"),
    ],
)
def test_bad_budgets_are_refused_with_the_values_seen(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        plan_capacity(LLAMA_8B, **kwargs)


def test_bad_layouts_are_refused():
    with pytest.raises(InvalidRequest, match=r"^num_layers must be a positive integer; got num_layers=0$"):
        KVLayout(0, 8, 128, 16)
    with pytest.raises(InvalidRequest, match=r"^unknown KV cache dtype='bf17'; known: bf16"):
        KVLayout(32, 8, 128, 16, "bf17")


def test_format_size():
    assert format_size(141 * GIB) == "141.00 GiB" and format_size(3) == "3 B"


def test_free_memory_is_read_from_cuda_only():
    if cuda_available():
        free, label = device_free_memory("cuda")
        assert free > 0 and label.startswith("free memory of cuda")
    else:
        with pytest.raises(InvalidRequest, match=r"^no CUDA device to read free memory from \(device=cpu\)"):
            device_free_memory("cpu")


# --- the command ---------------------------------------------------------------------------------


def capacity(*argv: str) -> int:
    """`kvspec capacity ARGV` through the real command line (its argument checks included)."""
    return main(["capacity", *argv])


def test_capacity_prints_the_computation(capsys):
    code = capacity(
        "--gpu-mem",
        "141GiB",
        "--layers",
        "32",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--dtype",
        "bf16",
        "--block-size",
        "16",
        "--weights",
        "16GiB",
        "--overhead",
        "2GiB",
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "num_gpu_blocks 50380" in out
    assert "block bytes       2.00 MiB  = 2 x 32 layers x 8 kv_heads x 128 head_dim x 16 tokens x 2 B (bf16)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-mem", "10GiB", "--weights", "16GiB"], "no memory left for the KV cache"),
        (["--gpu-mem", "lots"], "--gpu-mem: 'lots' is not a size such as 141GiB"),
        (["--gpu-mem", "141"], "--gpu-mem: '141' has no unit: write 141GiB"),
        (["--gpu-mem", "1GiB", "--margin", "1.5"], "--margin: must be in [0, 1); got 1.5"),
        (["--gpu-mem", "1GiB", "--dtype", "bf17"], "unknown KV cache dtype='bf17'"),
    ],
)
def test_capacity_exits_2_with_the_reason(capsys, argv, message):
    code = capacity("--layers", "32", "--kv-heads", "8", "--head-dim", "128", *argv)
    assert code == 2
    assert message in capsys.readouterr().err


def test_capacity_without_gpu_mem_reads_the_device(capsys):
    code = capacity("--layers", "32", "--kv-heads", "8", "--head-dim", "128")
    if cuda_available():
        assert code == 0 and "free memory of cuda" in capsys.readouterr().out
    else:
        assert code == 2 and "pass gpu_mem" in capsys.readouterr().err
