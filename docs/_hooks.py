"""MkDocs hooks: every table or page a command prints is generated from the command when the site is built.

Nothing here is copied by hand into a page. A page asks for a generated part
with a line of its own, `<!-- kvspec:generate NAME ARGS -->`, and
`on_page_markdown` replaces that line with what `GENERATORS[NAME]` makes from
the command's output; an unknown name, a command that fails or an anchor that
is gone fails the build (`PluginError`), so a page cannot silently keep an
old answer. `on_files` adds the step-through pages that `kvspec demo --html`
and `kvspec view` write: seed 000's walkthrough, and one page per trace kept
in docs/traces/ (scripts/docs-traces.sh writes those traces from the mutants).

The commands run in this process through the `kvspec` console script's module
(its `main`; the function `.venv/bin/kvspec` calls runs the same in a child
process), not through a harness module's path: the harness's modules move
between layers, the console script stays. One build
runs each command once (`_run` caches per build; `on_config` clears it, so
`mkdocs serve` regenerates on every rebuild).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shlex
import tempfile
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TRACES = DOCS / "traces"  # <invariant>.trace.jsonl, written by scripts/docs-traces.sh
PLUGIN_MATRIX = DOCS / "data" / "plugin-matrix.json"  # written by scripts/docs-plugins.sh
WALKTHROUGH_PAGE = "walkthrough/seed-000.html"
PLACEHOLDER = re.compile(r"^<!-- kvspec:generate (?P<args>.+?) -->[ \t]*$", re.MULTILINE)

_cache: dict[tuple[str, ...], str] = {}


# --- the command line ---------------------------------------------------------------------------


def _cli() -> Callable[[Sequence[str]], int]:
    """The `main` of the `kvspec` console script's module: the command in this process (the script's own
    function runs it in a child process, whose output this build could not capture)."""
    found = list(entry_points(group="console_scripts", name="kvspec"))
    if len(found) != 1:
        raise PluginError(f"the kvspec console script is not installed here (found {len(found)} entry points)")
    main: Callable[[Sequence[str]], int] = importlib.import_module(found[0].module).main
    return main


def _run(*argv: str, expect: int = 0) -> str:
    """What `kvspec ARGV` prints on stdout; the build fails when it exits with another code than `expect`."""
    key = (str(expect), *argv)
    if key in _cache:
        return _cache[key]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = _cli()(list(argv))
        except SystemExit as e:  # argparse exits on --help and on bad usage
            code = e.code if isinstance(e.code, int) else 2
    if code != expect:
        raise PluginError(f"`kvspec {shlex.join(argv)}` exited {code}, not {expect}: {err.getvalue()[-2000:]}")
    _cache[key] = out.getvalue()
    return _cache[key]


# --- the hooks ----------------------------------------------------------------------------------


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """A new build: run every command again."""
    _cache.clear()
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the step-through pages: seed 000's walkthrough and one per kept trace."""
    with tempfile.TemporaryDirectory(prefix="kvspec-docs-") as tmp:
        page = Path(tmp) / "walkthrough.html"
        _run("demo", "--html", str(page))
        files.append(File.generated(config, WALKTHROUGH_PAGE, content=page.read_bytes()))
        for trace in kept_traces():
            page = Path(tmp) / f"{trace_name(trace)}.html"
            _run("view", str(trace), "-o", str(page))
            files.append(File.generated(config, f"traces/{trace_name(trace)}.html", content=page.read_bytes()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace each `<!-- kvspec:generate NAME ARGS -->` line with what its generator makes."""

    def generate(match: re.Match[str]) -> str:
        name, *args = shlex.split(match["args"])
        if name not in GENERATORS:
            raise PluginError(f"{page.file.src_uri}: no generator {name!r}; known: {', '.join(sorted(GENERATORS))}")
        try:
            return GENERATORS[name](*args).rstrip("\n")
        except PluginError:
            raise
        except Exception as e:  # a generator that breaks names the page and the line, then fails the build
            raise PluginError(f"{page.file.src_uri}: `{match['args']}` failed: {type(e).__name__}: {e}") from e

    return PLACEHOLDER.sub(generate, markdown)


# --- the kept traces ----------------------------------------------------------------------------


def kept_traces() -> list[Path]:
    """docs/traces/*.trace.jsonl, in name order."""
    return sorted(TRACES.glob("*.trace.jsonl"))


def trace_name(trace: Path) -> str:
    """The invariant a kept trace breaks: its file name without `.trace.jsonl`."""
    return trace.name.removesuffix(".trace.jsonl")


def read_trace_lines(trace: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """The header, the steps and the recorded verdict line (or None) of a trace file."""
    lines = [json.loads(line) for line in trace.read_text(encoding="utf-8").splitlines() if line.strip()]
    header, rest = lines[0], lines[1:]
    verdict = rest.pop() if rest and "verdict" in rest[-1] else None
    return header, rest, verdict


def snapshot_from_json(obj: dict[str, Any]) -> Any:
    """A trace's recorded snapshot as the spec's `Snapshot` (the trace format's encoding: hashes as hex)."""
    from kvspec.spec.state import Snapshot

    def digest(h: str | None) -> bytes | None:
        return None if h is None else bytes.fromhex(h)

    tables = obj["block_tables"]
    return Snapshot(
        num_gpu_blocks=obj["num_gpu_blocks"],
        enable_caching=obj["enable_caching"],
        ref_cnt=tuple(obj["ref_cnt"]),
        block_hash=tuple(digest(h) for h in obj["block_hash"]),
        free_queue=tuple(obj["free_queue"]),
        hash_to_blocks=tuple((digest(h), tuple(bs)) for h, bs in obj["hash_to_blocks"]),
        block_tables=None if tables is None else tuple((rid, tuple(bs)) for rid, bs in tables),
        quarantined=tuple(obj["quarantined"]),
        kv_groups=tuple(obj.get("kv_groups", ())),
    )


def rule_broken_by(trace: Path) -> tuple[str, bool] | None:
    """The rule a trace shows broken at its last step, and whether the harness named it itself.

    The harness names a rule when it is what failed first (the failure's kind is `invariant`). Otherwise
    it stopped at the last step on something it checks before the rules (a different result or error),
    and the rule is the first one `kvspec.spec.check_all` (then `check_step`) finds broken on the
    implementation's state recorded after that step: every earlier state passed every rule, or the
    harness would have stopped there. None when neither names a rule.
    """
    from kvspec.spec import InvariantViolation, check_all
    from kvspec.spec.invariants import check_step

    _, steps, verdict = read_trace_lines(trace)
    failure = (verdict or {}).get("failure") or {}
    if failure.get("kind") == "invariant" and failure.get("invariant"):
        return failure["invariant"], True
    if not steps or steps[-1].get("impl_snapshot") is None:
        return None
    after = snapshot_from_json(steps[-1]["impl_snapshot"])
    try:
        check_all(after)
        if len(steps) > 1 and steps[-2].get("impl_snapshot") is not None:
            check_step(snapshot_from_json(steps[-2]["impl_snapshot"]), after, steps[-1]["op"])
    except InvariantViolation as e:
        return e.name, False
    return None


def mutant_list() -> list[dict[str, str]]:
    """`kvspec mutants --list` read back: name, level, factory, kind and the bug in one sentence, per mutant."""
    lines = _run("mutants", "--list").splitlines()
    mutants = []
    for head, body in zip(lines[0::2], lines[1::2]):
        name, level, factory = head.split(None, 2)
        kind, _, description = body.strip().partition(": ")
        mutants.append({"name": name, "level": level, "factory": factory, "kind": kind, "description": description})
    if not mutants or len(lines) != 2 * len(mutants):
        raise PluginError(f"`kvspec mutants --list` printed {len(lines)} lines, not two per mutant")
    return mutants


# --- generators ---------------------------------------------------------------------------------


def _code(text: str, info: str = "text") -> str:
    return f"```{info}\n{text.rstrip()}\n```"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def gen_output(*argv: str) -> str:
    """What a cheap command prints, as a text block (`kvspec demo`, `kvspec invariants`, ...)."""
    return _code(_run(*argv))


def gen_mutant_table() -> str:
    """Every mutant `kvspec mutants --list` names, and the kept trace it gives an invariant, if any."""
    featured = {read_trace_lines(t)[0].get("impl"): trace_name(t) for t in kept_traces()}
    rows = []
    for m in mutant_list():
        trace = featured.get(m["factory"])
        shown = f"[{trace}](../guides/invariants-broken.md#{trace})" if trace else ""
        rows.append([f"`{m['name']}`", m["level"], m["kind"], m["description"], shown])
    table = _table(["mutant", "level", "kind of bug", "the bug", "the invariant page that shows it"], rows)
    return f"{table}\n\n{len(rows)} mutants (`kvspec mutants --list`)."


def gen_invariant_traces() -> str:
    """Per rule of `kvspec invariants --json`: its words, what enforces it, and the shortest kept trace breaking it."""
    rules = json.loads(_run("invariants", "--json"))
    by_factory = {m["factory"]: m for m in mutant_list()}
    traces = {trace_name(t): t for t in kept_traces()}
    unknown = sorted(set(traces) - {r["name"] for r in rules})
    if unknown:
        raise PluginError(f"docs/traces holds traces for rules `kvspec invariants` does not name: {unknown}")
    parts = []
    for rule in rules:
        name = rule["name"]
        enforced = []
        if rule["contracts"]:
            enforced.append(f"the spec's contracts ({len(rule['contracts'])} operations)")
        if rule["machine"]:
            enforced.append("the conformance machine")
        enforced += [f"lemma {lemma}" for lemma in rule["lemmas"]]
        enforced += [f"through `{t}`" for t in rule["through"]]
        design = f" (design id `{rule['design_id']}`)" if rule["design_id"] else ""
        section = [f"## {name}", "", f"*{rule['kind']}*{design}: {rule['rule']}", "",
                   f"Enforced by: {', '.join(enforced) or 'nothing named'}."]  # fmt: skip
        if rule["how"]:
            section += ["", rule["how"]]
        trace = traces.get(name)
        if trace is None:
            section += ["", "No mutant's shrunk trace shows this rule broken, so none is kept for it."]
            parts.append("\n".join(section))
            continue
        header, steps, _ = read_trace_lines(trace)
        mutant = by_factory.get(header.get("impl"))
        if mutant is None:
            raise PluginError(f"{trace}: its implementation {header.get('impl')!r} is no mutant of --list")
        broken = rule_broken_by(trace)
        if broken is None or broken[0] != name:
            raise PluginError(f"{trace} does not show {name} broken (it shows {broken}): run scripts/docs-traces.sh")
        if broken[1]:
            how = f"the harness names the rule at step {len(steps)}" if steps else "the pool breaks it once built"
        else:
            how = (f"the harness stops at step {len(steps)} on what it checks first (a different result or "
                   "error), and the mutant's state after that step breaks this rule")  # fmt: skip
        section += [
            "",
            f"**Broken by the mutant `{mutant['name']}`** ({mutant['kind']}): {mutant['description']}. "
            f"Its shrunk trace has {len(steps)} step{'' if len(steps) == 1 else 's'}; {how}. "
            "`kvspec replay` tells it:",
            "",
            _code(_replay_story(trace, header["impl"])),
            "",
            f"[Step through it](../traces/{name}.html) (the spec beside the mutant, the divergence marked) · "
            f"[the trace](../traces/{name}.trace.jsonl) · "
            f"`kvspec replay docs/traces/{name}.trace.jsonl --impl {header['impl']}`",
        ]
        parts.append("\n".join(section))
    return "\n\n".join(parts)


def _replay_story(trace: Path, impl: str) -> str:
    """The story `kvspec replay TRACE --impl IMPL` tells (it must diverge), without its temporary file names."""
    with tempfile.TemporaryDirectory(prefix="kvspec-docs-replay-") as tmp:
        out = _run("replay", str(trace), "--impl", impl, "--trace-dir", tmp, expect=1)
    lines = out.splitlines()
    first = next((i for i, line in enumerate(lines) if re.match(r"^(DIVERGES|CRASHED|HUNG)\b", line)), None)
    if first is None:
        raise PluginError(f"`kvspec replay {trace.name}` told no story:\n{out[-2000:]}")
    story = [line for line in lines[first:] if not line.startswith(("trace: ", "replay: ", "verdict: "))]
    return "\n".join(story).strip()


def _vllm_module(name: str) -> Any:
    """A module of the vLLM target. NOTE: no command prints the release table or the event facts yet, so
    they are read from the target's own modules."""
    try:
        return importlib.import_module(f"kvspec.conformance.targets.vllm.{name}")
    except ImportError as e:
        raise PluginError(f"no vLLM target module {name!r} ({e})") from None


def _releases_module() -> Any:
    return _vllm_module("releases")


def gen_release_facts() -> str:
    """The declared facts of every release, one row per run of releases that agree on all of them."""
    releases = _releases_module()
    words = releases.HASH_CHAIN_DIFFERENCES

    def row(version: str) -> tuple[str, ...]:
        f = releases.facts_for(version)
        return (
            "yes" if f.has_null_block else "no (ids shifted by one)",
            "`vllm-v1` (hashless left)" if f.free_order == "hashless_left" else "`vllm-v1-tail` (all right)",
            f"{f.free_end_without_caching} end",
            {"no_null_block": "-", "decrements_ref_cnt": "`ref_cnt` -1", "skipped": "skipped"}[f.null_on_free],
            "skipped" if f.touch_skips_null else ("`ref_cnt` +1" if f.has_null_block else "-"),
            "`num_gpu_blocks`" if f.usage_counts_null else "`num_gpu_blocks - 1`",
            "yes" if f.has_evict_blocks else "no",
            "yes" if f.has_is_block_writable else "no",
            "yes" if f.free_has_evict_first_kwarg else "no",
            "to its own pool" if f.blocks_know_their_pool else "-",
            f"`{f.hash_algos[0]}`",
            "; ".join(words[d] for d in f.hash_chain_differs) or "kvspec's",
        )

    runs: list[list[Any]] = []
    for version in releases.RELEASES:
        facts = row(version)
        if runs and runs[-1][2] == facts:
            runs[-1][1] = version
        else:
            runs.append([version, version, facts])
    header = [
        "releases", "null block", "freed, caching on", "freed, caching off", "`free_blocks([null])`",
        "`touch([null])`", "`get_usage` divides by", "`evict_blocks`", "`is_block_writable`",
        "`free_blocks(evict_first=)`", "a block of another pool freed", "default hash",
        "block-hash chain against kvspec's",
    ]  # fmt: skip
    rows = [[first if first == last else f"{first} - {last}", *facts] for first, last, facts in runs]
    every = [releases.facts_for(v) for v in releases.RELEASES]
    overallocate = sorted({f.overallocate_error for f in every})
    double_free = sorted({f.double_free_error or "nothing (`ref_cnt` goes to -1)" for f in every})
    return _table(header, rows) + (
        f"\n\n{len(every)} releases, {every[0].version} to {every[-1].version}. Over-allocation raises "
        f"{' or '.join(f'`{e}`' for e in overallocate)}; a double free raises {' or '.join(double_free)}."
    )


def gen_releases_covered() -> str:
    """The releases the table declares, as words inside a sentence ("0.8.0 to 0.34.0 (51 releases)")."""
    releases = _releases_module().RELEASES
    return f"{releases[0]} to {releases[-1]} ({len(releases)} releases)"


def gen_release_events() -> str:
    """What each release's KV cache events carry, as declared, one row per run of releases that agree."""
    releases, events = _releases_module(), _vllm_module("events")
    forms = {"hash_value": "the key's own int (`hash_value`)", "digest": "the digest, by default its last 8 bytes"}

    def row(version: str) -> tuple[str, ...]:
        f = events.event_facts(version)
        if not f.has_events:
            return ("none (no `take_events`)", "", "", "")
        published = ", ".join(f"`{field}`" for field in f.published)
        if "extra_keys" in f.published and not f.extra_keys_as_spec:
            published += " (`extra_keys` as a bare identifier)"
        missing = ", ".join(f"`{k}`" for k in sorted(events.fields_not_published(f, version))) or "none"
        return ("yes", forms[f.hash_form], published, missing)

    runs: list[list[Any]] = []
    for version in releases.RELEASES:
        facts = row(version)
        if runs and runs[-1][2] == facts:
            runs[-1][1] = version
        else:
            runs.append([version, version, facts])
    header = ["releases", "events", "keys published as", "spec fields of `BlockStored` published",
              "declared not applicable"]  # fmt: skip
    return _table(header, [[a if a == b else f"{a} - {b}", *facts] for a, b, facts in runs])


def gen_plugin_matrix() -> str:
    """The matrix `kvspec oracle --plugins --json` printed, recorded in docs/data/plugin-matrix.json."""
    recorded = json.loads(PLUGIN_MATRIX.read_text(encoding="utf-8"))
    rows = []
    for row in recorded["rows"]:
        if row.get("error"):
            could_not = f"could not run: {row['error']}"
            rows.append([row["plugin"], row["base"], f"`{row['profile']}`", could_not, "", "", ""])
            continue
        cells = [_plugin_cell(row["cells"].get(k)) for k in ("pool/on", "pool/off", "manager/on", "manager/off")]
        rows.append([row["plugin"], row["base"], f"`{row['profile']}`", *cells])
    header = ["plugin", "runs on", "profile", "pool, caching on", "pool, caching off", "request, caching on",
              "request, caching off"]  # fmt: skip
    probes = []
    for row in recorded["rows"]:
        for p in row.get("probes", []):
            where = f"{'request' if p['level'] == 'manager' else 'pool'}, caching {'on' if p['caching'] else 'off'}"
            finding = p.get("finding") or "a divergence not described yet"
            said = "conforms" if p["verdict"] == "conforms" else f"{p['verdict']}: {finding}"
            probes.append([row["impl"], p["name"], where, said])
    return (
        _table(header, rows)
        + f"\n\nRecorded {recorded['recorded']} with `{recorded['command']}`.\n\n**The directed probes**\n\n"
        + _table(["target", "probe", "where", "verdict: finding"], probes)
    )


def _plugin_cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    verdict = cell["verdict"]
    if verdict in ("conforms", "n/a"):
        return "ok" if verdict == "conforms" else "n/a"
    return f"{verdict}: {cell.get('finding') or 'a divergence not described yet'}"


def gen_example_lines(path: str, anchor: str, count: str = "1") -> str:
    """The lines of an examples/ file from the first one that holds `anchor`, with their line number."""
    lines = (ROOT / "examples" / path).read_text(encoding="utf-8").splitlines()
    found = [i for i, line in enumerate(lines) if anchor in line]
    if not found:
        raise PluginError(f"examples/{path} has no line with {anchor!r} any more")
    first = found[0]
    shown = "\n".join(lines[first : first + int(count)])
    last = first + int(count)
    where = f"line {first + 1}" if int(count) == 1 else f"lines {first + 1}-{last}"
    return f"`examples/{path}`, {where}:\n\n" + _code(shown, "python")


GENERATORS: dict[str, Callable[..., str]] = {
    "output": gen_output,
    "mutant-table": gen_mutant_table,
    "invariant-traces": gen_invariant_traces,
    "release-facts": gen_release_facts,
    "releases-covered": gen_releases_covered,
    "release-events": gen_release_events,
    "plugin-matrix": gen_plugin_matrix,
    "example-lines": gen_example_lines,
}
