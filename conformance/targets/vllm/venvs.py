"""A virtual environment per vLLM release, for the request level: vLLM installed lean, on a CPU.

The request level drives vLLM's real ``KVCacheManager``, ``Request`` and
``SamplingParams``, which import far more of vLLM than light mode can stand in
for; so a release's request level runs in an environment with that release
installed. The lean recipe keeps one to about 2.2 GB and 70-130 s:
``pip install --no-deps vllm==X``, the CPU build of torch 2.13.0, a short list
of dependencies (``LEAN_DEPS``), then whatever module the import of vLLM's
KVCacheManager still misses, and kvspec itself from this checkout.

The environments live under ``venv_root()`` beside light mode's cache and are
shared by every kvspec checkout on the machine: one made from another
checkout is pointed at this one before it is used. The rejected alternative,
vLLM's full dependency set, is a CUDA toolchain's worth of wheels per release.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvspec.conformance.targets.vllm.lightmode import cache_dir
from kvspec.conformance.targets.vllm.releases import version_key

__all__ = ["LEAN_DEPS", "TORCH_PIN", "WORKER_ENV", "ensure_venv", "venv_root"]

# Pinned: the CPU build on the registry; an unpinned torch is a multi-GB CUDA download.
TORCH_PIN = "torch==2.13.0+cpu"
# What importing vLLM's KVCacheManager, Request and SamplingParams needs on a CPU.
LEAN_DEPS: tuple[str, ...] = (
    "packaging", "psutil", "pyzmq", "urllib3", "regex", "numpy", "msgspec", "pydantic", "cbor2",
    "aiohttp", "requests", "openai", "openai_harmony", "pillow", "pybase64", "cachetools", "cloudpickle",
    "uvloop", "py-cpuinfo", "prometheus_client", "fastapi", "partial-json-parser", "blake3", "sentencepiece",
    "tokenizers", "pyyaml", "einops", "setproctitle", "diskcache", "llguidance",
)  # fmt: skip
# Import names that differ from their distribution's name (for the missing-module loop).
_MODULE_TO_DIST = {"yaml": "pyyaml", "cv2": "opencv-python-headless", "google": "protobuf", "PIL": "pillow",
                   "cpuinfo": "py-cpuinfo", "zmq": "pyzmq"}  # fmt: skip
# Set for every process that imports vLLM: 0.8.x decorates model code with
# torch.compile at import, which torch 2.13's dynamo rejects; nothing here compiles.
WORKER_ENV: dict[str, str] = {"TORCHDYNAMO_DISABLE": "1"}
_IMPORT_CHECK = (
    "from vllm.v1.core.kv_cache_manager import KVCacheManager; from vllm.v1.request import Request; "
    "from vllm import SamplingParams; print('IMPORT OK')"
)
_MAX_IMPORT_ROUNDS = 12  # rounds of installing a module the import still misses

_Step = Callable[[Sequence[str], str], "subprocess.CompletedProcess[str]"]


def venv_root() -> Path:
    """Where the per-release virtual environments live: beside the light-mode cache."""

    return cache_dir().parent / "vllm-venvs"


def _kvspec_source() -> Path | None:
    """The kvspec project folder, when kvspec runs from a checkout (editable install)."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").exists() else None


def _stepper(version: str, log: Callable[[str], None]) -> _Step:
    """Runs one step of the recipe; a failed step (but the import check, which may fail) raises."""

    def run(cmd: Sequence[str], what: str) -> subprocess.CompletedProcess[str]:
        log(f"vllm=={version}: {what}")
        proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False, env={**os.environ, **WORKER_ENV})
        if proc.returncode != 0 and "IMPORT" not in what:
            tail = "\n".join(line for line in proc.stderr.splitlines() if "WARNING" not in line)[-600:]
            raise RuntimeError(f"{what} failed (rc={proc.returncode}): {tail}")
        return proc

    return run


def ensure_venv(version: str, log: Callable[[str], None] = lambda _: None) -> Path:
    """A virtual environment with vLLM ``version`` and kvspec, created once under ``venv_root()``.

    The lean recipe: ``pip install --no-deps vllm==X``, ``torch==2.13.0+cpu``,
    ``LEAN_DEPS`` (and ``transformers<4.54`` before 0.24, whose imports break on
    later ones), then up to 12 rounds of installing whatever module the import
    of vLLM's KVCacheManager still misses, then kvspec itself without
    dependencies plus hypothesis and icontract. The environments are shared by
    every kvspec checkout on the machine: one made from another checkout gets
    this one's kvspec installed (a few seconds) before it is used.

    Returns:
        The environment's python.

    Raises:
        RuntimeError: a step failed; the message names the step and pip's last words.
    """
    root = venv_root() / version
    python = root / "bin" / "python"
    done = root / "KVSPEC_READY"  # the release, then the kvspec checkout installed in it
    source = _kvspec_source()
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run = _stepper(version, log)
    if done.exists():
        # The environments are shared by every checkout on this machine: one made
        # from another checkout is pointed at this one, so it runs this kvspec.
        if source is not None and done.read_text().split("\n")[1:2] != [str(source)]:
            run([*pip, "--no-deps", "-e", str(source)], f"pip install kvspec from {source}")
            done.write_text(f"{version}\n{source}\n")
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", str(root)], "create the environment")
    _install_release(version, pip, run)
    _install_missing_modules(python, pip, run)
    if source is None:
        raise RuntimeError("kvspec is not running from a source checkout; cannot install it into the environment")
    run([*pip, "--no-deps", "-e", str(source)], "pip install kvspec")
    run([*pip, "hypothesis", "icontract", "cbor2"], "pip install kvspec's dependencies")
    done.write_text(f"{version}\n{source}\n")
    return python


def _install_release(version: str, pip: Sequence[str], run: _Step) -> None:
    """vLLM without its dependencies, the CPU torch and the lean list (transformers by the release's age)."""
    run([*pip, "--no-deps", f"vllm=={version}"], "pip install --no-deps vllm")
    run([*pip, TORCH_PIN], f"pip install {TORCH_PIN}")
    transformers = "transformers>=4.51.1,<4.54" if version_key(version) < version_key("0.24.0") else "transformers"
    run([*pip, *LEAN_DEPS, transformers], "pip install the lean dependencies")
    run([*pip, "--no-deps", "xgrammar", "apache-tvm-ffi"], "pip install --no-deps xgrammar")


def _install_missing_modules(python: Path, pip: Sequence[str], run: _Step) -> None:
    """Install, round by round, the module the import of vLLM's KVCacheManager still misses."""
    for _ in range(_MAX_IMPORT_ROUNDS):
        proc = run([str(python), "-c", _IMPORT_CHECK], "IMPORT check")
        if "IMPORT OK" in proc.stdout:
            return
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        if "No module named '" not in last:
            raise RuntimeError(f"importing vLLM's KVCacheManager fails: {last}")
        module = last.split("No module named '")[1].split("'")[0].split(".")[0]
        run([*pip, _MODULE_TO_DIST.get(module, module)], f"pip install {module} (missing at import)")
    raise RuntimeError(f"importing vLLM's KVCacheManager still misses modules after {_MAX_IMPORT_ROUNDS} rounds")
