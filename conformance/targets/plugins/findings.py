"""What a plugin check finds, in words: directed probes, and the catalogue of known divergences.

A campaign reports the shortest trace of the first divergence it meets; a
plugin that differs from vLLM in several ways needs one trace per way. The
directed probes are those traces, written out: a few steps each, run through
the harness's lock-step exactly as a campaign's steps are (no shrinking
needed), saved as traces that ``kvspec replay`` replays to the same verdict.

Each known divergence of a plugin is a `Finding`: the operation and message
its first failing check has, one sentence of what the plugin does and what
vLLM and the spec do instead, and what it can affect. A failure that matches
no finding is reported as a new divergence, with the harness's own message.

Wording, on purpose: a divergence is a difference from vLLM's pool (and the
spec); it is called a bug only where an invariant breaks: wrong reuse,
leaked blocks, negative counts, a crash on a legal call.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvspec.conformance.core.adapter import AdapterConfig
from kvspec.conformance.core.lockstep import ConformanceFailure, LockStep, run_spec
from kvspec.conformance.core.results import Failure, Verdict
from kvspec.conformance.core.trace import write_trace
from kvspec.conformance.targets.vllm.probes import PROBES, ProbeResult

__all__ = ["EFFECTS", "GENERIC_PROBES", "Effect", "Finding", "PluginProbe", "match_finding", "run_probe"]

Effect = Literal["KV reuse", "hit cap", "order", "errors", "crash", "bookkeeping", "result"]
# What each effect means, as the matrix's legend prints it.
EFFECTS: dict[str, str] = {
    "KV reuse": "can hand a request blocks whose KV is not its prefix's",
    "hit cap": "a prefix hit covers the whole prompt, leaving no token to compute (vLLM keeps the last one)",
    "order": "which free block is handed out or evicted first; reuse stays correct",
    "errors": "what a caller mistake gets (no error, another error, a crash); correct calls are unaffected",
    "crash": "raises on a legal call",
    "bookkeeping": "counts or tables disagree with the blocks; reuse stays correct",
    "result": "a legal call answers differently (usage, reset's answer); no block is affected",
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One known divergence of a plugin from vLLM's pool and the spec."""

    key: str  # a short name, e.g. "hashless-fifo"
    op: str  # the operation of the first failing step
    pattern: str  # a regular expression the failure's message matches
    plugin_does: str  # one sentence: what the plugin does, and what vLLM and the spec do instead
    effect: Effect  # what it can affect (EFFECTS)
    is_bug: bool = False  # an invariant breaks: wrong reuse, leaked blocks, negative counts, a crash on a legal call
    caching: bool | None = None  # only with prefix caching on (True) or off (False); None: either

    def matches(self, op: str | None, message: str, caching: bool) -> bool:
        """Whether a failing step (its operation and the harness's message) is this finding."""
        if self.caching is not None and self.caching != caching:
            return False
        return op == self.op and re.search(self.pattern, message) is not None


def match_finding(
    findings: Sequence[Finding], failure: Failure | ProbeResult | None, caching: bool = True
) -> Finding | None:
    """The first finding a failure matches, or None (none, or a divergence not described yet)."""
    if failure is None:
        return None
    return next((f for f in findings if f.matches(failure.op, failure.message, caching)), None)


@dataclass(frozen=True, slots=True)
class PluginProbe:
    """A short scenario, run once through the lock-step against a plugin."""

    name: str  # what it shows, in a few words
    steps: tuple[tuple[str, tuple[Any, ...]], ...]  # (op, args), args as the trace records them
    level: Literal["pool", "manager"] = "pool"
    caching: bool = True
    num_gpu_blocks: int = 4
    block_size: int = 4
    # For a plugin that declares it ignores the caller mistake of the last step: the
    # steps whose spec state it must then reach (the bad call replaced by its good part).
    ignored_as: tuple[tuple[str, tuple[Any, ...]], ...] | None = None


def _ignored_check(probe: PluginProbe, config: AdapterConfig, record: Any) -> str:
    """Whether an ignored mistake left the state the good part alone gives, in words."""

    assert probe.ignored_as is not None, "only a probe with ignored_as is checked as ignored"
    impl = record.impl_snapshot
    expected = run_spec(config, probe.ignored_as)[-1][1] if probe.ignored_as else None
    if record.impl is None or record.impl.error is not None or record.impl.crashed or impl is None:
        return "; declared ignored, but the call did not return normally"
    if expected is not None and impl != expected:
        return f"; declared ignored, but the state is not what {[op for op, _ in probe.ignored_as]} alone gives"
    return "; declared ignored: the good part of the call applied and the bad part changed nothing"


# vLLM's historical pool bugs and caller mistakes (the regression oracle's probes), for every pool-level plugin.
GENERIC_PROBES: tuple[PluginProbe, ...] = tuple(PluginProbe(p.name, p.steps) for p in PROBES)


def run_probe(
    factory: Callable[[AdapterConfig], Any],
    probe: PluginProbe,
    profile: str,
    trace_dir: str | None,
    impl_name: str,
) -> ProbeResult | None:
    """Run one probe through the lock-step; None when the adapter lacks one of its operations.

    Returns:
        "conforms", or the failure's kind, step, operation and message, and
        the saved trace (when ``trace_dir`` is given).
    """

    config = AdapterConfig(level=probe.level, num_gpu_blocks=probe.num_gpu_blocks, enable_caching=probe.caching,
                           profile=profile, block_size=probe.block_size)  # fmt: skip
    lock = LockStep(factory, config)
    if any(not callable(getattr(lock.adapter, op, None)) for op, _ in probe.steps):
        return None
    try:
        lock.check()
        for op, args in probe.steps:
            lock.call(op, *[list(a) if isinstance(a, list) else a for a in args])
            lock.check()
    except ConformanceFailure as e:
        f = e.failure
        note = ""
        if probe.ignored_as is not None and f.step == len(probe.steps) and lock.records:
            note = _ignored_check(probe, config, lock.records[-1])
        result = ProbeResult(probe.name, f.kind.value, f.step, f.op, f.message + note)
        if trace_dir is not None:
            slug = re.sub(r"[^0-9a-zA-Z]+", "-", probe.name).strip("-")
            path = Path(trace_dir) / f"{impl_name.replace('@', '-')}-probe-{slug}.trace.jsonl"
            try:
                result.trace_path = str(write_trace(path, lock.trace(impl_name)))
            except OSError as e:  # the finding stands; its trace is missing
                result.message += f" (trace not saved in {trace_dir}: {e.strerror or e})"
        return result
    return ProbeResult(probe.name, Verdict.CONFORMS.value)
