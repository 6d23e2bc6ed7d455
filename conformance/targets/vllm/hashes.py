"""Golden hash vectors: kvspec's block-hash chain against a vLLM's, on the same inputs.

External KV caches (LMCache, Mooncake) reuse blocks across processes and
machines only when every party computes the same chain. This module runs
vLLM's own request-level chain function (``hash_request_tokens`` before 0.10.1,
``get_request_block_hasher`` after) on a fixed set of requests (token blocks,
LoRA, multimodal inputs, cache_salt, several NONE_HASH seeds) and compares
every block hash with ``kvspec.spec.hashing.hash_request_blocks``.

Where a release's scheme differs, the report says how, from measurements, not
from the version number: whether NONE_HASH differs (its derivation), whether a
chain without extra keys differs (serializer or chained value), whether only
requests with extra keys differ (the extra-key format; the release's own keys
for the first block are shown).

vLLM reads request attributes through its ``Request`` class. In light mode
that class is not loaded, so the chain functions get a ``_HashRequest``: the
attributes they read (``all_token_ids``, ``lora_request``, ``mm_features`` or
``mm_positions``/``mm_hashes``, ``cache_salt``, ...), filled from the case.

The builtin hash (Python's ``hash()``) is equal across processes only under
the same ``PYTHONHASHSEED``, fixed when the interpreter starts: its vectors are
computed in a subprocess started with that seed, kvspec's and vLLM's side by
side.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvspec.conformance.targets.vllm.adapter import VllmRelease, installed_release, light_release
from kvspec.conformance.targets.vllm.releases import HASH_CHAIN_DIFFERENCES, HashChainDifference, facts_for
from kvspec.spec.hashing import (
    VLLM_NONE_HASH_SEED,
    MultiModalInput,
    block_extra_keys,
    hash_request_blocks,
    none_hash,
)

__all__ = [
    "FLEET_SEED",
    "GOLDEN_CASES",
    "FleetAnswer",
    "HashCase",
    "HashReport",
    "ProcessChains",
    "ReleaseHashing",
    "VectorResult",
    "compare_release",
    "default_hash_fn",
    "golden_vectors",
    "hash_seed_env",
    "judge_release",
    "kvspec_chain",
    "measure_release",
    "measure_releases",
    "vllm_chain",
]

# None: PYTHONHASHSEED unset (vLLM 0.29+ then seeds sha256 chains with "vllm-none-hash").
Seed = str | None


@dataclass(frozen=True, slots=True)
class HashCase:
    """One request whose block-hash chain is compared."""

    name: str  # short label in reports
    token_ids: tuple[int, ...]  # the prompt
    block_size: int  # tokens per block
    lora: tuple[int, str, str] | None = None  # (lora_int_id, lora_name, lora_path)
    mm_inputs: tuple[MultiModalInput, ...] = ()  # sorted by offset, as vLLM assumes
    cache_salt: str | None = None  # first block only


GOLDEN_CASES: tuple[HashCase, ...] = (
    HashCase("plain", tuple(range(16)), 4),
    HashCase("partial-last-block", tuple(range(100, 110)), 4),
    HashCase("block-size-1", (7, 7, 7), 1),
    HashCase("block-size-16-large-ids", tuple(151_000 + i for i in range(32)), 16),
    HashCase("lora", tuple(range(12)), 4, lora=(3, "sql-lora", "/adapters/sql")),
    HashCase("cache-salt", tuple(range(12)), 4, cache_salt="tenant-a"),
    HashCase(
        "multimodal",
        tuple(range(16)),
        4,
        mm_inputs=(MultiModalInput("img-a", 2, 5), MultiModalInput("img-b", 9, 3)),
    ),
    HashCase(
        "all-extra-keys",
        tuple(range(16)),
        4,
        lora=(1, "l", "/l"),
        mm_inputs=(MultiModalInput("img-a", 4, 4),),
        cache_salt="s",
    ),
)

# PYTHONHASHSEED values the vectors are computed under (None: unset).
GOLDEN_SEEDS: tuple[Seed, ...] = (None, "0", "12345")


def kvspec_seed(seed: Seed) -> str:
    """The kvspec seed that matches vLLM run under ``PYTHONHASHSEED=seed`` (unset: vLLM's fixed default)."""
    return VLLM_NONE_HASH_SEED if seed is None else seed


def kvspec_chain(case: HashCase, hash_fn: str, seed: Seed, *, lora_path: bool = True) -> list[bytes]:
    """kvspec's chain for a case, with the options that match vLLM 0.31+.

    Args:
        case: The request.
        hash_fn: ``sha256``, ``sha256_cbor`` or ``builtin``.
        seed: The ``PYTHONHASHSEED`` vLLM runs under (None: unset).
        lora_path: Put the LoRA path in the LoRA key, as vLLM 0.31+ does.

    Returns:
        One digest per full block.
    """
    return list(
        hash_request_blocks(
            case.token_ids,
            case.block_size,
            case.lora[1] if case.lora else None,
            case.mm_inputs,
            case.cache_salt,
            hash_fn,
            kvspec_seed(seed),
            lora_path=case.lora[2] if case.lora and lora_path else None,
        )
    )


class _Position:
    """A multimodal placeholder range, readable as vLLM's ``PlaceholderRange`` (attributes or keys)."""

    def __init__(self, offset: int, length: int) -> None:
        self.offset = offset  # first token position
        self.length = length  # token positions covered

    def __getitem__(self, key: str) -> int:
        value: int = getattr(self, key)
        return value


class _Feature:
    """A multimodal input as vLLM's ``MultiModalFeatureSpec`` (0.11+) exposes it to the hasher."""

    def __init__(self, identifier: str, position: _Position) -> None:
        self.identifier = identifier  # content hash of the input
        self.mm_hash = identifier  # the same, under its other name
        self.mm_position = position  # where it sits in the prompt


class _LoRA:
    """The fields of vLLM's ``LoRARequest`` that block hashing reads."""

    def __init__(self, lora_int_id: int, lora_name: str, lora_path: str) -> None:
        self.lora_int_id = lora_int_id
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.name = lora_name
        self.path = lora_path
        self.adapter_id = lora_int_id


class _HashRequest:
    """The attributes of vLLM's ``Request`` that its chain functions read, filled from a case."""

    def __init__(self, case: HashCase) -> None:
        positions = [_Position(mm.offset, mm.length) for mm in case.mm_inputs]
        self.request_id = case.name
        self.all_token_ids = list(case.token_ids)
        self._all_token_ids = self.all_token_ids  # 0.34.0's hasher reads the buffer behind all_token_ids
        self.prompt_token_ids = list(case.token_ids)
        self.num_tokens = len(case.token_ids)
        self.block_hashes: list[Any] = []
        self.lora_request = _LoRA(*case.lora) if case.lora else None
        self.mm_features = [_Feature(mm.identifier, p) for mm, p in zip(case.mm_inputs, positions)]
        self.mm_positions = positions
        self.mm_hashes = [mm.identifier for mm in case.mm_inputs]
        self.cache_salt = case.cache_salt
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}


def golden_vectors() -> list[dict[str, Any]]:
    """The block hashes vLLM 0.33.0 computes for ``GOLDEN_CASES``, from its own hasher (``golden_hashes.json``).

    Returns:
        One entry per (case, hash function, PYTHONHASHSEED): ``block_hashes`` as hex digests.
    """
    path = Path(__file__).with_name("golden_hashes.json")
    vectors: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))["vectors"]
    return vectors


@contextlib.contextmanager
def hash_seed_env(seed: Seed) -> Iterator[None]:
    """``PYTHONHASHSEED`` set to ``seed`` (or unset) while vLLM derives NONE_HASH."""
    saved = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved


def _digest(value: Any, hash_fn: str) -> bytes:
    """A chain value as bytes: vLLM 0.10.2+ digests as they are; earlier int hash values in fixed width."""
    value = getattr(value, "hash_value", value)
    if isinstance(value, bytes):
        return value
    if hash_fn == "builtin":
        return int(value).to_bytes(8, "big", signed=True)
    return int(value).to_bytes(8 if hash_fn.endswith("64bit") else 32, "big")


def _prepare(release: VllmRelease, hash_fn: str) -> Callable[[Any], Any]:
    """The release's hash function, with NONE_HASH derived (where the release defers it) under the current env."""
    fn = release.hash_functions[hash_fn]
    ku = release.kv_cache_utils
    if hasattr(ku, "init_none_hash"):
        ku.init_none_hash(fn)
    return fn


def vllm_chain(release: VllmRelease, case: HashCase, hash_fn: str) -> list[bytes]:
    """vLLM's chain for a case, by its own request-level chain function, under the current ``PYTHONHASHSEED``.

    Returns:
        One digest per full block.
    """
    return _chain(release, case, hash_fn, _prepare(release, hash_fn))


def _chain(release: VllmRelease, case: HashCase, hash_fn: str, fn: Callable[[Any], Any]) -> list[bytes]:
    """vLLM's chain for a case with ``fn``, NONE_HASH as the release holds it now (derived once, as an engine does)."""
    ku = release.kv_cache_utils
    request = _HashRequest(case)
    if hasattr(ku, "get_request_block_hasher"):
        hashes = ku.get_request_block_hasher(case.block_size, fn)(request)
    elif "hash_function" in ku.hash_request_tokens.__code__.co_varnames[:1]:
        hashes = ku.hash_request_tokens(fn, case.block_size, request)
    else:  # 0.8.0 to 0.8.2: builtin hash() only
        hashes = ku.hash_request_tokens(case.block_size, request)
    return [_digest(h, hash_fn) for h in hashes]


def _vllm_none_hash(release: VllmRelease, hash_fn: str) -> bytes | None:
    fn = _prepare(release, hash_fn)
    value = getattr(release.kv_cache_utils, "NONE_HASH", None)
    del fn
    return None if value is None else _digest(value, hash_fn)


def _vllm_first_extra_keys(release: VllmRelease, case: HashCase) -> Any:
    ku = release.kv_cache_utils
    keys, _ = ku.generate_block_hash_extra_keys(_HashRequest(case), 0, case.block_size, 0)
    return keys


@dataclass(frozen=True, slots=True)
class VectorResult:
    """One (case, hash function, seed) comparison."""

    case: str  # HashCase.name
    hash_fn: str  # the vLLM name of the hash function
    seed: Seed  # PYTHONHASHSEED (None: unset)
    kvspec: list[str]  # hex digests, one per full block
    vllm: list[str]  # the same from vLLM
    match: bool  # every block hash equal


@dataclass(slots=True)
class HashReport:
    """Hash compatibility of one vLLM with kvspec's chain."""

    version: str  # the vLLM release
    source: str  # "installed" or "light"
    results: list[VectorResult] = field(default_factory=list)  # every comparison run
    differences: list[str] = field(default_factory=list)  # how the scheme differs, per hash function
    skipped: list[str] = field(default_factory=list)  # comparisons not run, and why

    @property
    def compatible(self) -> bool:
        """Every comparison matched (and at least one ran)."""
        return bool(self.results) and all(r.match for r in self.results)

    def summary(self) -> str:
        """One line for a matrix cell."""
        if not self.results:
            return "n/a (" + "; ".join(self.skipped) + ")"
        num_ok = sum(r.match for r in self.results)
        if num_ok == len(self.results):
            return f"compatible ({num_ok} vectors)"
        return f"differs ({num_ok}/{len(self.results)} vectors match): " + "; ".join(self.differences)

    def to_json(self) -> dict[str, Any]:
        """A plain dict for ``--json``."""
        data = asdict(self)
        data["compatible"] = self.compatible
        return data


def _explain(release: VllmRelease, hash_fn: str, seed: Seed, failed: Sequence[VectorResult]) -> str:
    """How the release's scheme differs, measured under one seed."""
    reasons: list[str] = []
    theirs = _vllm_none_hash(release, hash_fn)
    ours = bytes(none_hash(hash_fn, kvspec_seed(seed)))
    if theirs is not None and theirs != ours:
        reasons.append(
            f"NONE_HASH derivation (PYTHONHASHSEED={seed}: vLLM {theirs.hex()[:12]}.. kvspec {ours.hex()[:12]}..)"
        )
    plain_failed = [
        r for r in failed if not _case(r.case).lora and not _case(r.case).mm_inputs and not _case(r.case).cache_salt
    ]
    if plain_failed and (theirs is None or theirs == ours):
        reasons.append("serializer or chained value (a chain without extra keys differs)")
    extra_failed = [_case(r.case) for r in failed if r not in plain_failed]
    if extra_failed and not plain_failed:
        shown = []
        for case in extra_failed[:2]:
            kv = block_extra_keys(0, case.block_size, case.lora[1] if case.lora else None, case.mm_inputs,
                                  case.cache_salt, case.lora[2] if case.lora else None)  # fmt: skip
            shown.append(f"{case.name}: vLLM {_vllm_first_extra_keys(release, case)!r} kvspec {kv!r}")
        reasons.append("extra-key format (" + "; ".join(shown) + ")")
    return f"{hash_fn}: " + (", ".join(reasons) or "chains differ")


def _case(name: str) -> HashCase:
    return next(c for c in GOLDEN_CASES if c.name == name)


def _fresh_for_seed(version: str, source: str, seed: Seed) -> VllmRelease | None:
    """A copy of the release whose import-time NONE_HASH (0.8.x to 0.9.x) saw ``seed``."""
    with hash_seed_env(seed):
        if source == "light":
            return light_release(version, fresh=True)
    current = os.environ.get("PYTHONHASHSEED")
    return installed_release() if current == seed else None


def compare_release(
    version: str | None,
    *,
    hash_fns: Sequence[str] | None = None,
    seeds: Sequence[Seed] = GOLDEN_SEEDS,
    cases: Sequence[HashCase] = GOLDEN_CASES,
    builtin_in_subprocess: bool = True,
) -> HashReport:
    """Compare kvspec's chain with one vLLM's on every case, hash function and seed.

    Args:
        version: A release to load in light mode, or None for the installed vLLM.
        hash_fns: Hash functions to compare; default: those of the release that kvspec has.
        seeds: ``PYTHONHASHSEED`` values (None: unset).
        cases: The requests.
        builtin_in_subprocess: Compare ``builtin`` in subprocesses started with each seed.

    Returns:
        The report.
    """
    base = light_release(version) if version else installed_release()
    source = "light" if version else "installed"
    report = HashReport(base.version, source)
    wanted = [f for f in (hash_fns or ("sha256", "sha256_cbor", "builtin")) if f in base.hash_functions]
    for f in hash_fns or ():
        if f not in base.hash_functions:
            report.skipped.append(f"{f}: vllm=={base.version} has no such hash function")
    for hash_fn in wanted:
        if hash_fn == "builtin":
            if builtin_in_subprocess:
                for seed in seeds:
                    if seed is None:
                        continue  # hash() is random per process without a seed: nothing to agree on
                    report.results += _builtin_in_subprocess(version, seed, cases)
            continue
        explained = False
        for seed in seeds:
            release = _fresh_for_seed(base.version, source, seed)
            if release is None:
                report.skipped.append(
                    f"{hash_fn} PYTHONHASHSEED={seed}: the installed vLLM is already imported under another seed"
                )
                continue
            failed: list[VectorResult] = []
            for case in cases:
                with hash_seed_env(seed):
                    theirs = vllm_chain(release, case, hash_fn)
                ours = kvspec_chain(case, hash_fn, seed)
                result = VectorResult(case.name, hash_fn, seed, [h.hex() for h in ours], [h.hex() for h in theirs],
                                      ours == theirs)  # fmt: skip
                report.results.append(result)
                if not result.match:
                    failed.append(result)
            if failed and not explained:
                with hash_seed_env(seed):
                    report.differences.append(_explain(release, hash_fn, seed, failed))
                explained = True
    return report


def _builtin_in_subprocess(version: str | None, seed: str, cases: Sequence[HashCase]) -> list[VectorResult]:
    """The builtin-hash vectors, computed in a fresh interpreter started with ``PYTHONHASHSEED=seed``."""
    env = dict(os.environ, PYTHONHASHSEED=seed)
    cmd = [sys.executable, "-m", "kvspec.conformance.targets.vllm.hashes", "--builtin-worker", version or "", seed]
    cmd += [c.name for c in cases]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"builtin hash worker for vllm {version or 'installed'} exited rc={proc.returncode}: "
                           f"{proc.stderr.strip()[-800:]}")  # fmt: skip
    return [VectorResult(**row) for row in json.loads(proc.stdout)]


def _builtin_worker(version: str, seed: str, case_names: Sequence[str]) -> None:
    assert os.environ.get("PYTHONHASHSEED") == seed, "the worker must be started under its PYTHONHASHSEED"
    release = light_release(version) if version else installed_release()
    rows = []
    for name in case_names:
        case = _case(name)
        theirs = vllm_chain(release, case, "builtin")
        ours = kvspec_chain(case, "builtin", seed)
        rows.append(asdict(VectorResult(name, "builtin", seed, [h.hex() for h in ours], [h.hex() for h in theirs],
                                        ours == theirs)))  # fmt: skip
    json.dump(rows, sys.stdout)


# ---------------------------------------------------------------------------
# what a fleet needs, and where a release's chain is kvspec's: measured in fresh interpreters

# The PYTHONHASHSEED both engine processes of a fleet set, for the "set" half of the fleet check.
FLEET_SEED = "12345"

FleetAnswer = Literal["yes", "only with PYTHONHASHSEED set", "only with PYTHONHASHSEED unset", "no"]

# Extra-key kinds as kvspec (and vLLM since 0.31) tag them; a key that starts with none of them is untagged.
_TAGS = frozenset({"lora", "mm", "cache_salt", "prompt_embeds"})


def default_hash_fn(version: str) -> str:
    """The hash function a release uses unless told otherwise (its ``prefix_caching_hash_algo`` default).

    Raises:
        KeyError: ``version`` is not a release the facts table covers.
    """
    return facts_for(version).hash_algos[0]


@dataclass(frozen=True, slots=True)
class ProcessChains:
    """What one fresh interpreter computed for one release, NONE_HASH derived once as an engine derives it."""

    version: str  # the release
    hash_fn: str  # its default hash function
    pythonhashseed: str | None  # the interpreter's PYTHONHASHSEED (None: unset)
    chains: dict[str, list[str]]  # golden case -> vLLM's block hashes, hex
    kvspec_match: dict[str, bool]  # golden case -> vLLM's chain is kvspec's (same hash_fn, kvspec_seed(seed))
    none_hash_match: bool | None  # vLLM's NONE_HASH is kvspec's (None: the release keeps no NONE_HASH)
    extra_keys_tagged: bool  # vLLM's extra keys of the all-extra-keys case's first block are tagged tuples


@dataclass(frozen=True, slots=True)
class ReleaseHashing:
    """A release's hash chain as a fleet and a router see it: two processes per PYTHONHASHSEED setting."""

    version: str  # the release
    hash_fn: str  # its default hash function, the one measured
    fleet: FleetAnswer  # whether two engine processes started alike compute the same chain
    differences: tuple[HashChainDifference, ...]  # how its chain differs from kvspec's; () where it is kvspec's
    python: str  # the interpreter the processes ran (the builtin hash depends on it)

    @property
    def is_kvspec_chain(self) -> bool:
        """vLLM's chain equals kvspec's on every golden case, PYTHONHASHSEED set and unset."""
        return not self.differences

    def fleet_line(self) -> str:
        """The fleet answer in one line, with what it was measured on."""
        return (f"fleet-consistent hashes: {self.fleet} (vllm=={self.version}, {self.hash_fn}, two processes with "
                f"PYTHONHASHSEED={FLEET_SEED} and two with it unset, Python {self.python})")  # fmt: skip

    def chain_line(self) -> str:
        """Whether the chain is kvspec's, in one line (the reasons where not)."""
        if self.is_kvspec_chain:
            return f"chain: kvspec's ({self.hash_fn}, PYTHONHASHSEED set and unset)"
        why = "; ".join(HASH_CHAIN_DIFFERENCES[d] for d in self.differences)
        return f"chain: not kvspec's ({self.hash_fn}: {why})"


def _is_tagged(keys: Any) -> bool:
    """Every extra key is a tuple that starts with its kind (``("lora", ...)``), as kvspec's are."""
    return bool(keys) and all(isinstance(k, tuple) and k and k[0] in _TAGS for k in keys)


def _process_chains(release: VllmRelease, version: str) -> ProcessChains:
    """One release's row of a chain worker, under this interpreter's PYTHONHASHSEED."""
    seed = os.environ.get("PYTHONHASHSEED")
    hash_fn = default_hash_fn(version)
    fn = _prepare(release, hash_fn)  # once, as an engine derives NONE_HASH once at start-up
    chains: dict[str, list[str]] = {}
    match: dict[str, bool] = {}
    for case in GOLDEN_CASES:
        theirs = _chain(release, case, hash_fn, fn)
        chains[case.name] = [h.hex() for h in theirs]
        match[case.name] = theirs == kvspec_chain(case, hash_fn, seed)
    value = getattr(release.kv_cache_utils, "NONE_HASH", None)
    none_match = None if value is None else _same_none_hash(value, hash_fn, seed)
    tagged = _is_tagged(_vllm_first_extra_keys(release, _case("all-extra-keys")))
    return ProcessChains(version, hash_fn, seed, chains, match, none_match, tagged)


def _same_none_hash(value: Any, hash_fn: str, seed: str | None) -> bool:
    """Whether a release's NONE_HASH is kvspec's for the same hash function and seed.

    Compared as numbers where the release keeps an int: 0.8.3 to 0.9.x derive
    it with sha256 whatever the chain's hash function, a 256-bit int that no
    8-byte builtin hash equals.
    """
    ours = bytes(none_hash(hash_fn, kvspec_seed(seed)))
    value = getattr(value, "hash_value", value)
    if isinstance(value, bytes):
        return value == ours
    if hash_fn == "builtin":
        return int(value) == int.from_bytes(ours, "big", signed=True)
    return int(value) == int.from_bytes(ours, "big")


def _chain_worker(versions: Sequence[str]) -> None:
    """Print, as JSON, this interpreter's ``ProcessChains`` for each release ("" names the installed vLLM)."""
    rows = []
    for version in versions:
        release = light_release(version, fresh=True) if version else installed_release()
        rows.append(asdict(_process_chains(release, version or release.version)))
    json.dump(rows, sys.stdout)


def _spawn_chain_workers(versions: Sequence[str], seed: str | None, num: int) -> list[subprocess.Popen[str]]:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    cmd = [sys.executable, "-m", "kvspec.conformance.targets.vllm.hashes", "--chain-worker", *versions]
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(num)]  # fmt: skip


def _collect(proc: subprocess.Popen[str], what: str) -> list[ProcessChains]:
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"chain worker ({what}) gave no answer within 600 s") from None
    if proc.returncode != 0:
        tail = [line for line in err.strip().splitlines() if line.strip()][-1:] or ["?"]
        raise RuntimeError(f"chain worker ({what}) exited rc={proc.returncode}: {tail[0][:400]}")
    return [ProcessChains(**row) for row in json.loads(out)]


def judge_release(
    with_seed: tuple[ProcessChains, ProcessChains], unset: tuple[ProcessChains, ProcessChains], python: str
) -> ReleaseHashing:
    """A release's answers from its four processes: two under ``PYTHONHASHSEED=FLEET_SEED``, two with it unset.

    Fleet-consistent under a setting: its two processes computed the same
    chain for every golden case. How the chain differs from kvspec's, in
    order: under the seed, the first of NONE_HASH (where the release keeps
    one), a chain without extra keys, the extra keys (untagged or not); then,
    unset, NONE_HASH (or, where nothing differed under the seed, any chain).

    Args:
        with_seed: The two processes started with ``PYTHONHASHSEED=FLEET_SEED``.
        unset: The two started without it.
        python: The interpreter's version, recorded with the answer.

    Returns:
        The release's ``ReleaseHashing``.
    """
    same_set = with_seed[0].chains == with_seed[1].chains
    same_unset = unset[0].chains == unset[1].chains
    fleet: FleetAnswer = "no"
    if same_set and same_unset:
        fleet = "yes"
    elif same_set or same_unset:
        fleet = "only with PYTHONHASHSEED set" if same_set else "only with PYTHONHASHSEED unset"
    seeded, plain = with_seed[0], {c.name for c in GOLDEN_CASES if not (c.lora or c.mm_inputs or c.cache_salt)}
    found: list[HashChainDifference] = []
    if seeded.none_hash_match is False:
        found.append("none_hash")
    elif not all(seeded.kvspec_match[c] for c in plain):
        found.append("chain")
    elif not all(seeded.kvspec_match.values()):
        found.append("extra_keys" if seeded.extra_keys_tagged else "untagged_extra_keys")
    # Unset, vLLM 0.29+ derives NONE_HASH from a fixed seed, kvspec's VLLM_NONE_HASH_SEED; earlier ones do not.
    if unset[0].none_hash_match is False or (not found and not all(unset[0].kvspec_match.values())):
        found.append("unset_seed")
    return ReleaseHashing(seeded.version, seeded.hash_fn, fleet, tuple(found), python)


_MEASURED: dict[str, ReleaseHashing] = {}


def measure_releases(versions: Sequence[str]) -> dict[str, ReleaseHashing]:
    """Measure, for each release, fleet consistency and whether its chain is kvspec's (kept for the process run).

    Four fresh interpreters compute every release asked for (each release
    loaded anew in each, NONE_HASH derived once): two with
    ``PYTHONHASHSEED=FLEET_SEED``, two with it unset. A release is
    fleet-consistent under a setting when its two processes agree on every
    golden case's chain.

    Args:
        versions: Releases from the facts table ("" for the installed vLLM).

    Returns:
        ``{version: ReleaseHashing}`` (the installed vLLM under its own version).

    Raises:
        RuntimeError: a worker failed (the message has its last line) or gave no answer in 600 s.
        KeyError: a release the facts table does not cover (its default hash function is not known).
    """
    for version in versions:
        if version:
            default_hash_fn(version)  # an unknown release is refused before any process starts
    wanted = [v for v in dict.fromkeys(versions) if v not in _MEASURED]
    if wanted:
        procs = {seed: _spawn_chain_workers(wanted, seed, 2) for seed in (FLEET_SEED, None)}
        runs = {seed: [_collect(p, f"PYTHONHASHSEED={seed or 'unset'}") for p in ps] for seed, ps in procs.items()}
        python = platform.python_version()
        # Each worker answers in the order asked: row i of every worker is release wanted[i].
        for i, key in enumerate(wanted):
            with_seed = (runs[FLEET_SEED][0][i], runs[FLEET_SEED][1][i])
            _MEASURED[key] = judge_release(with_seed, (runs[None][0][i], runs[None][1][i]), python)
    return {_MEASURED[v].version: _MEASURED[v] for v in versions}


def measure_release(version: str) -> ReleaseHashing:
    """``measure_releases`` for one release (kept for the process run)."""
    return next(iter(measure_releases([version]).values()))


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--builtin-worker":
        _builtin_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "--chain-worker":
        _chain_worker(sys.argv[2:])
    else:
        sys.exit(
            "usage: python -m kvspec.conformance.targets.vllm.hashes --builtin-worker VERSION SEED CASE... "
            "| --chain-worker VERSION..."
        )
