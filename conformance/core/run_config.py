"""One run configuration: every knob of a conformance run in one frozen record, validated once.

`kvspec check`, `kvspec replay` and `run_check` each turn what they were
given into one `RunConfig`; its constructor checks every field (type, range,
the combinations that would do nothing) and refuses a bad value with a
`ConfigError`: one line naming the value and the limit. Everything after
reads the record and nothing re-reads arguments: a configuration's campaign
(`Configuration`, one implementation at one level and caching mode), the
machine's settings, and the `AdapterConfig` an adapter is built from
(`adapter_config`, the one function that builds it from the record).

The model is Hypothesis's `settings`: one object, every default documented
beside its field, checked when it is made. The rejected alternative was the
one before it: a run's arguments passed on by hand from the command line to
`run_check`, a campaign plan, the machine's class variables and the adapter
config, each retyping and re-checking part of them.

What the record cannot know alone stays with whoever can answer: whether a
device exists is the implementation runtime's question (the command line
asks gpu_impl before a run starts; a user's adapter refuses a device it does
not have when it is built), and whether an output path can be written is
checked when the command line parses it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from hypothesis.database import ExampleDatabase

from kvspec.conformance.core.adapter import AdapterConfig, Level
from kvspec.conformance.core.strategies import MAX_BLOCK_SIZE, MAX_GROUP_SPAN, MAX_MANAGER_POOL
from kvspec.spec.attention import KVGroup, format_groups, parse_groups
from kvspec.spec.errors import InvalidRequest
from kvspec.spec.ordering import is_profile, known_profiles

__all__ = [
    "AUTO",
    "DEFAULT_BUILD_TIMEOUT_S",
    "DEFAULT_COVER_ROUNDS",
    "DEFAULT_TRACE_DIR",
    "DRAWN",
    "LIMITS",
    "MAX_SECONDS",
    "ConfigError",
    "Configuration",
    "Limit",
    "RunConfig",
    "adapter_config",
    "with_groups_resolved",
]

# Where failure traces go unless the caller says: a folder in the current one, created only
# when a trace is written (never the temporary directory, where no one looks for them).
DEFAULT_TRACE_DIR = Path("kvspec-traces")
DRAWN = "drawn"  # `groups`: one layout drawn per example
# `profile`: find which vLLM profiles the implementation follows (kvspec check --profile auto);
# `groups`: every kind the implementation declares, drawn (`with_groups_resolved`; kvspec check's default).
AUTO = "auto"


@dataclass(frozen=True)
class Limit:
    """The integers a count may take: from `least` to `most`, and why no more."""

    least: int
    most: int | None  # None: no upper limit
    why: str = ""  # what a larger value would mean, for the refusal


# The documented limits of the counts. A larger value is a typo or a run that never ends.
LIMITS: dict[str, Limit] = {
    # With --time-budget the budget alone decides: the run asks for this many and stops on time.
    "max_examples": Limit(1, 10**9, "a larger campaign never ends; a time budget bounds one by time"),
    # Hypothesis runs at most a few hundred rules per example anyway (its buffer fills).
    "steps": Limit(1, 10_000, "Hypothesis's buffer ends an example long before that"),
    # Rounds stop as soon as every branch is reached; with a time budget, a large number means "while time lasts".
    "cover_rounds": Limit(0, 10**6, "each round is as long as the campaign; a time budget bounds them by time"),
    # Fixed, not the machine's CPU count: the same configuration is valid on every machine
    # (one seed and job count, one campaign). Each job is a forked process with its own memory.
    "jobs": Limit(1, 64, "each job is a forked process; one per core is fastest"),
    "seed": Limit(0, None),
}
# The least time one call (or a build) may be given: below it, whether a call "hangs" would be the machine's
# scheduling and the timer's resolution, not the implementation.
MIN_CALL_LIMIT_S = 0.1
_CALL_LIMIT_WHY = "a shorter limit would time the machine's scheduling, not the implementation"
MAX_SECONDS = 7 * 24 * 3600.0  # a time budget or step timeout above a week is a typo (a timer overflows far later)
# Importing vLLM on a loaded 2-core machine takes a minute or more; no step of the spec's comes near it.
DEFAULT_BUILD_TIMEOUT_S = 300.0
# Rounds on the next seeds while a branch the implementation can reach is unreached (they run only then):
# with a verdict that needs every such branch, six keep the default campaigns conclusive at the request level.
DEFAULT_COVER_ROUNDS = 6


class ConfigError(ValueError):
    """A run configuration refused: one line naming the field, the value and the limit.

    `str(e)` names the field as Python does (`jobs must be a positive integer; got jobs=0`);
    `short` is the refusal without the field's name, for a command line to put after its flag
    (`--jobs: must be at least 1; got 0`).
    """

    def __init__(self, name: str, message: str, short: str | None = None) -> None:
        super().__init__(message)
        self.name = name  # the RunConfig field refused
        self.short = short if short is not None else message


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """What a run checks, and how: built once from the command line or `run_check`, validated when made.

    Raises:
        ConfigError: a field has the wrong type, is out of its limit (`LIMITS`), or does nothing in this
            configuration (KV cache groups at the pool level only; a report `--profile auto` does not write).
    """

    impls: tuple[str, ...] = ()  # the implementations' names; () for one factory passed without a name
    levels: tuple[Level, ...] = ("pool", "manager")  # the adapter levels checked, each a configuration
    caching: tuple[bool, ...] = (True, False)  # prefix caching on, off, or each in turn
    profile: str = "vllm-v1"  # the ordering profile claimed (spec.ordering), or AUTO: every vLLM profile
    # The manager level's KV cache groups (spec.attention), normalized; or DRAWN; or AUTO: DRAWN for an
    # implementation that declares kv_cache_groups, one full group for one that does not.
    groups: str = "full"
    events: bool = False  # check the KV cache events and hit statistics too (AdapterConfig.events)
    device: str | None = None  # AdapterConfig.device of every adapter built; None: the adapter picks
    max_examples: int = 100  # examples per configuration (LIMITS)
    steps: int = 50  # rules per example: Hypothesis's stateful_step_count (LIMITS)
    cover_rounds: int = DEFAULT_COVER_ROUNDS  # more rounds on the next seeds while a branch is unreached (LIMITS)
    time_budget_s: float | None = None  # wall-clock seconds for the whole run; None: the examples decide
    step_timeout_s: float | None = 10.0  # the most one implementation call may take; None: no limit
    # The most importing and building the implementation may take (each adapter built; the first build
    # of a process imports it): its own limit, so a slow import is not a hung step. None: no limit.
    build_timeout_s: float | None = DEFAULT_BUILD_TIMEOUT_S
    seed: int = 0  # the first chunk's seed: the same seed and jobs give the same campaign (LIMITS)
    jobs: int = 1  # forked processes a campaign's examples are shared among (LIMITS)
    shrink: bool = True  # shrink a failure Hypothesis found; False: report it as found
    minimize_s: float = 30.0  # time to cut down a trace a dead or hung process left (0: not cut)
    isolate: bool = True  # run each campaign in a child process (crash- and hang-proof)
    trace_dir: Path | None = DEFAULT_TRACE_DIR  # where failure traces go (created when one is written); None: not saved
    html_dir: Path | None = None  # also write a step-through page of each failure trace here
    junit: Path | None = None  # also write a JUnit XML report here
    json: Path | Literal["-"] | None = None  # also write the summary as JSON here ("-": stdout)
    keep_deepest: bool = False  # also save each configuration's deepest example
    database: ExampleDatabase | None = field(default=None, compare=False)  # Hypothesis's example database
    # The folder the run started in (the current one when the record is made): what the run names relative
    # to it (its outputs, a file an implementation's name names) means a path in it for the whole run.
    folder: Path = field(default_factory=Path.cwd, compare=False)

    def __post_init__(self) -> None:
        for problem in _problems(self):
            raise problem
        # Resolved once, here: an implementation's import runs in this process, and one that changes the
        # current folder (os.chdir) would otherwise move the run's traces and reports into its own.
        object.__setattr__(self, "folder", self.folder.absolute())
        for name in ("trace_dir", "html_dir", "junit", "json"):
            path = getattr(self, name)
            if isinstance(path, Path) and not path.is_absolute():  # None and "-" (stdout) are no paths
                object.__setattr__(self, name, self.folder / path)
        if self.groups not in (DRAWN, AUTO):  # normal form: "full, sliding:8" -> "full,sliding:8"
            object.__setattr__(self, "groups", format_groups(parse_groups(self.groups)))

    def configurations(self) -> Iterator[Configuration]:
        """Each implementation at each level and caching mode, in that order (one unnamed one without names)."""
        for impl in self.impls or (None,):
            for level in self.levels:
                for caching in self.caching:
                    yield Configuration(self, impl, level, caching, self.time_budget_s)


@dataclass(frozen=True, slots=True)
class Configuration:
    """One configuration of a run: one implementation at one level and caching mode, under the run's record."""

    run: RunConfig
    impl: str | None  # the implementation's name, for reports and trace headers (None: a factory without one)
    level: Level
    enable_caching: bool
    time_budget_s: float | None  # this configuration's share of the run's budget
    is_replay: bool = False  # one recorded trace re-run: no examples asked for, one process
    # With groups drawn: the sets of attention types a layout may mix, those the implementation was probed
    # to build (strategies.KIND_COMBINATIONS); None: every one.
    group_kinds: frozenset[frozenset[str]] | None = None

    @property
    def groups(self) -> str:
        """The KV cache groups checked: the run's at the manager level; the pool level has one full group."""
        return self.run.groups if self.level == "manager" else "full"


def adapter_config(
    configuration: Configuration,
    num_gpu_blocks: int,
    block_size: int = 4,
    groups: str | None = None,
    hashing: tuple[str, str] | None = None,
) -> AdapterConfig:
    """The `AdapterConfig` an adapter of `configuration` is built with (the one place the record becomes one).

    Args:
        configuration: the configuration the adapter is checked in.
        num_gpu_blocks: the pool's size, the null block included (drawn per example).
        block_size: tokens per block (drawn per example at the manager level).
        groups: this example's KV cache groups; None: the configuration's ("full" where it draws them
            or has them resolved per implementation).
        hashing: the (hash_fn, seed) the implementation hashes with; None: kvspec's defaults.
    """
    run = configuration.run
    layout = groups if groups is not None else configuration.groups
    extra = {"hash_fn": hashing[0], "seed": hashing[1]} if hashing is not None else {}
    return AdapterConfig(
        level=configuration.level,
        num_gpu_blocks=num_gpu_blocks,
        enable_caching=configuration.enable_caching,
        profile=run.profile,
        block_size=block_size,
        device=run.device,
        groups="full" if layout in (DRAWN, AUTO) else layout,
        events=run.events,
        **extra,
    )


def with_groups_resolved(
    configuration: Configuration, declares_groups: bool, group_kinds: frozenset[frozenset[str]] | None = None
) -> Configuration:
    """`configuration` made concrete for one implementation, as its probe found it: AUTO groups become every
    layout drawn where it declares ``kv_cache_groups = True``, one full-attention group where it does not;
    drawn layouts mix only the attention types it builds (`group_kinds`, None: any).

    Why per implementation, when it is built: whether an adapter builds several groups is its own
    declaration, read from the adapter object (a factory may be a plain function), and which attention
    types it builds, its answer (`LevelNotProvided`) to a layout of each kind; a run names several.
    """
    run = configuration.run
    if run.groups == AUTO:
        run = replace(run, groups=DRAWN if declares_groups else "full")
    kinds = group_kinds if run.groups == DRAWN else None
    return replace(configuration, run=run, group_kinds=kinds)


# --- the checks -------------------------------------------------------------------------------------


def _problems(config: RunConfig) -> Iterator[ConfigError]:
    """Every refusal of `config`, first found first (the constructor raises the first)."""
    yield from _choice_problems(config)
    for name in LIMITS:
        yield from _count_problem(name, getattr(config, name))
    yield from _seconds_problem("time_budget_s", config.time_budget_s)
    yield from _seconds_problem("step_timeout_s", config.step_timeout_s, MIN_CALL_LIMIT_S)
    yield from _seconds_problem("build_timeout_s", config.build_timeout_s, MIN_CALL_LIMIT_S)
    if isinstance(config.minimize_s, bool) or not isinstance(config.minimize_s, (int, float)):
        yield _typed("minimize_s", config.minimize_s, "a number of seconds")
    elif not 0 <= config.minimize_s <= MAX_SECONDS:
        yield _typed("minimize_s", config.minimize_s, f"from 0 to {MAX_SECONDS:g} seconds")
    yield from _flag_problems(config)
    yield from _output_problems(config)


def _choice_problems(config: RunConfig) -> Iterator[ConfigError]:
    """The implementations, levels, caching modes, profile, groups and device."""
    if not isinstance(config.impls, tuple) or not all(isinstance(i, str) and i for i in config.impls):
        yield _typed("impls", config.impls, "a tuple of implementation names")
    if not isinstance(config.levels, tuple) or not config.levels:
        yield _typed("levels", config.levels, "a non-empty tuple of 'pool' and 'manager'")
    for level in config.levels:
        if level not in ("pool", "manager"):
            yield ConfigError("levels", f"level must be 'pool' or 'manager'; got level={level!r}")
    if (
        not isinstance(config.caching, tuple)
        or not config.caching
        or not all(isinstance(c, bool) for c in config.caching)
    ):
        yield _typed("caching", config.caching, "a non-empty tuple of True and False")
    if config.profile != AUTO and not is_profile(config.profile):
        known = known_profiles()
        yield ConfigError(
            "profile",
            f"unknown profile={config.profile!r}; known profiles: {known}",
            f"unknown profile {config.profile!r}; known profiles: {known}, or {AUTO}",
        )
    if config.groups not in (DRAWN, AUTO):
        try:
            groups = parse_groups(config.groups if isinstance(config.groups, str) else repr(config.groups))
        except InvalidRequest as e:
            yield ConfigError(
                "groups", f"{e}, or {DRAWN!r} for a layout drawn per example, or {AUTO!r} for what it declares"
            )
        else:
            too_wide = too_wide_for_campaigns(groups)
            if too_wide is not None:
                yield ConfigError("groups", too_wide)
    for name in ("events", "shrink", "isolate", "keep_deepest"):
        if not isinstance(getattr(config, name), bool):
            yield _typed(name, getattr(config, name), "True or False")
    if config.device is not None and (not isinstance(config.device, str) or not config.device.strip()):
        yield _typed("device", config.device, "a device name such as 'cpu' or 'cuda:0', or None")


def too_wide_for_campaigns(groups: tuple[KVGroup, ...]) -> str | None:
    """Why a layout's window or chunk is too wide for a request-level campaign, or None when none is."""
    wide = [g for g in groups if g.size > MAX_GROUP_SPAN]
    if not wide:
        return None
    return (
        f"KV cache group {str(wide[0])!r}: a window or chunk of at most {MAX_GROUP_SPAN} tokens, the widest a "
        f"request-level campaign can cross (its pools have at most {MAX_MANAGER_POOL} blocks of at most "
        f"{MAX_BLOCK_SIZE} tokens): no prompt would cross a wider one, so its branches could never be reached"
    )


def _count_problem(name: str, value: object) -> Iterator[ConfigError]:
    """A count outside its `LIMITS` entry: the Python form says the type too, the flag form the bound."""
    limit = LIMITS[name]
    kind = "a positive integer" if limit.least == 1 else "a non-negative integer"
    if isinstance(value, bool) or not isinstance(value, int) or value < limit.least:
        yield ConfigError(
            name, f"{name} must be {kind}; got {name}={value!r}", f"must be at least {limit.least}; got {value}"
        )
    elif limit.most is not None and value > limit.most:
        yield ConfigError(
            name,
            f"{name} must be at most {limit.most} ({limit.why}); got {name}={value!r}",
            f"must be at most {limit.most} ({limit.why}); got {value}",
        )


def _seconds_problem(name: str, value: object, least: float = 0.0) -> Iterator[ConfigError]:
    """Seconds: None, or a finite number above 0 (at least `least`, where given) and at most a week."""
    if value is None:
        return
    bound = f"must be at least {least:g} seconds ({_CALL_LIMIT_WHY})" if least else "must be above 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        yield _typed(name, value, "a finite number of seconds, or None")
    elif value <= 0 or value < least:
        yield ConfigError(name, f"{name} {bound}; got {name}={value!r}", f"{bound}; got {value:g}")
    elif value > MAX_SECONDS:
        yield ConfigError(
            name,
            f"{name} must be at most {MAX_SECONDS:g} seconds (a week); got {name}={value!r}",
            f"must be at most {MAX_SECONDS:g} seconds (a week); got {value:g}",
        )


def _flag_problems(config: RunConfig) -> Iterator[ConfigError]:
    """Settings that would do nothing in this configuration: refused rather than silently ignored."""
    layout = config.groups not in ("full", DRAWN, AUTO)
    if layout and isinstance(config.levels, tuple) and "manager" not in config.levels:
        yield ConfigError(
            "groups",
            f"groups={config.groups!r} does nothing at the pool level (levels={config.levels!r}): "
            "KV cache groups are the manager's",
            f"{config.groups} does nothing at the pool level: KV cache groups are the manager's (--level manager)",
        )


def _output_problems(config: RunConfig) -> Iterator[ConfigError]:
    """The outputs: paths (checked for writing by whoever parses them) and the example database."""
    if not isinstance(config.folder, Path):
        yield _typed("folder", config.folder, "a Path")
    for name in ("trace_dir", "html_dir", "junit"):
        if getattr(config, name) is not None and not isinstance(getattr(config, name), Path):
            yield _typed(name, getattr(config, name), "a Path or None")
    if config.json is not None and config.json != "-" and not isinstance(config.json, Path):
        yield _typed("json", config.json, "a Path, '-' (stdout) or None")
    if config.database is not None and not isinstance(config.database, ExampleDatabase):
        yield _typed("database", config.database, "a Hypothesis ExampleDatabase or None")


def _typed(name: str, value: object, kind: str) -> ConfigError:
    return ConfigError(name, f"{name} must be {kind}; got {name}={value!r}", f"must be {kind}; got {value!r}")
