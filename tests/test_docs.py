"""The documentation: the site builds in strict mode, every command shown is accounted for, kept traces replay.

The site (mkdocs.yml, docs/) is built with `mkdocs build --strict` into a
temporary folder, which runs every generator of docs/_hooks.py; the same
settings must fail on a broken link and on a page left out of the nav.

Every command block of README.md and docs/ carries a marker on the line before
it (docs/reference/test-suite.md, "The documentation", says what each means):
`<!-- run -->` blocks are run here, line by line, with the environment's
`kvspec` first on PATH, in a temporary folder that holds a copy of examples/
and links to docs/ and tests/; `<!-- run by: tests/...::test -->` must name a
test that exists; `<!-- not run: why -->` must say why.

Every trace kept in docs/traces/ is replayed on the mutant that wrote it (exit
1, the rule its name says broken at its last step) and on the reference (every
step conforms), through the `kvspec` console script's own function, so that
no module path of the harness is assumed here.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from markdown.extensions.toc import slugify

from kvspec.conformance.tools.cli import build_parser
from kvspec.mutants import all_mutants

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
SHELL_INFO = {"", "sh", "bash", "shell", "console"}
MARKER = re.compile(
    r"^<!-- (?:(?P<run>run)(?:: exits (?P<code>\d+)(?P<prints>, prints the next block)?)?"
    r"|run by: (?P<test>\S+)|not run: (?P<reason>.*?)) -->$"
)
# A command line: optional VAR=value assignments, then a command word and an argument. A word followed
# by a colon ("kvspec fuzz: ...") is a message a command printed, not a command.
COMMAND_LINE = re.compile(r"^\s*(?:\$ )?(?:[A-Z_][A-Z0-9_]*=\S* )*(?:kvspec|bash|pytest|pip) +(?!\S*:(?:\s|$))\S")
TRACE_NAME = re.compile(r"(failure|crashed|hung|deepest)-(\w+?)-[0-9a-f]{6}")


def _kvspec() -> str:
    """The `kvspec` console script of this environment."""
    beside = Path(sys.executable).parent / "kvspec"
    found = str(beside) if beside.exists() else shutil.which("kvspec")
    assert found, "no kvspec console script beside this python or on PATH"
    return found


@functools.cache
def _hooks() -> ModuleType:
    """docs/_hooks.py, loaded by path (it is the site's, not a package's)."""
    spec = importlib.util.spec_from_file_location("kvspec_docs_hooks", DOCS / "_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the blocks of the pages --------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A fenced block of a page."""

    path: Path
    line: int  # of the opening fence, 1-based
    info: str  # the fence's info string
    lines: tuple[str, ...]  # its content
    marker: str  # the line right before the opening fence
    after: Block | None = None  # the next block of the page, for a block whose output is shown

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[str]:
        """Its command lines, continuations joined, comment lines left out."""
        out: list[str] = []
        pending = ""
        for raw in self.lines:
            line = pending + raw.strip()
            pending = ""
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            if line and not line.startswith("#"):
                out.append(line)
        return out


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^( *)```([^`]*)$", lines[i])
        if opening is None:
            i += 1
            continue
        indent, info = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == f"{indent}```")
        marker = lines[i - 1].strip() if i > 0 else ""
        found.append(Block(path, i + 1, info.strip(), tuple(lines[i + 1 : end]), marker))
        i = end + 1
    return [
        Block(b.path, b.line, b.info, b.lines, b.marker, found[k + 1] if k + 1 < len(found) else None)
        for k, b in enumerate(found)
    ]


ALL_BLOCKS = [b for path in DOC_FILES for b in _blocks(path)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.info in SHELL_INFO]
# A block shown twice (a guide's recipe again in the README) runs once, where it is first shown.
RUN_BLOCKS = list(
    {
        (b.marker, tuple(b.commands())): b for b in reversed(SHELL_BLOCKS) if (m := MARKER.match(b.marker)) and m["run"]
    }.values()
)[::-1]


def test_the_pages_hold_command_blocks_of_every_kind() -> None:
    kinds = {k for b in SHELL_BLOCKS if (m := MARKER.match(b.marker)) for k, v in m.groupdict().items() if v}
    assert {"run", "code", "prints", "test", "reason"} <= kinds, kinds


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_every_command_block_is_run_or_says_why_not(block: Block) -> None:
    marker = MARKER.match(block.marker)
    assert marker is not None, (
        f"{block.where}: a command block needs <!-- run -->, <!-- run: exits N -->, <!-- run by: tests/...::test -->"
        f" or <!-- not run: why --> on the line before it; found {block.marker!r}"
    )
    assert block.commands(), f"{block.where}: a command block without a command"
    if marker["reason"] is not None:
        assert marker["reason"].strip(), f"{block.where}: <!-- not run: --> says no reason"
    if marker["test"] is not None:
        path, _, name = marker["test"].partition("::")
        test_file = ROOT / path
        assert test_file.is_file(), f"{block.where}: run by {marker['test']}, but {path} does not exist"
        *classes, function = name.split("::")
        source = test_file.read_text(encoding="utf-8")
        for cls in classes:
            assert re.search(rf"^class {cls}\b", source, re.M), f"{block.where}: {path} has no class {cls}"
        assert re.search(rf"^\s*def {function}\(", source, re.M), f"{block.where}: {path} has no test {function}"
    if marker["prints"]:
        assert block.after is not None and block.after.info == "text", f"{block.where}: no text block follows"


def test_output_blocks_hold_no_commands_and_python_blocks_compile() -> None:
    for block in ALL_BLOCKS:
        if block.info == "text":
            commands = [line for line in block.lines if COMMAND_LINE.match(line)]
            assert not commands, f"{block.where}: a text block shows commands, mark it sh: {commands}"
        elif block.info == "python":
            compile("\n".join(block.lines), block.where, "exec")
        else:
            assert block.info in SHELL_INFO, f"{block.where}: unknown block language {block.info!r}"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder to run documented commands in: a copy of examples/, links to docs/ and tests/."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("docs", "tests"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    return tmp_path


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.where)
def test_the_cheap_command_blocks_run(block: Block, workdir: Path) -> None:
    marker = MARKER.match(block.marker)
    assert marker is not None
    expected = int(marker["code"] or 0)
    env = {**os.environ, "PATH": f"{Path(_kvspec()).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("KVSPEC_EXAMPLE_BUG", None)
    printed = ""
    for command in block.commands():
        proc = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=300, check=False)  # fmt: skip
        assert proc.returncode == expected, (
            f"{block.where}: `{command}` exited {proc.returncode}, not {expected}\n{proc.stdout[-3000:]}"
            f"\n{proc.stderr[-3000:]}"
        )
        printed += proc.stdout
    if marker["prints"]:
        assert block.after is not None
        got = TRACE_NAME.sub(r"\1-\2-XXXXXX", printed)
        for line in block.after.lines:
            if line.strip() and line.strip() != "...":
                assert TRACE_NAME.sub(r"\1-\2-XXXXXX", line) in got, f"{block.where}: not printed: {line!r}\n{got}"


# --- the site -----------------------------------------------------------------------------------


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = _mkdocs_build(ROOT / "mkdocs.yml", site)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr
    # every page of the nav, and the generated pages
    nav_pages = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav_pages) == on_disk, "mkdocs.yml's nav must list every page of docs/"
    walkthrough = (site / "walkthrough" / "seed-000.html").read_text(encoding="utf-8")
    assert "<html" in walkthrough.lower() and len(walkthrough) > 10_000
    guide = site / "guides" / "walkthrough" / "index.html"
    frames = re.findall(r'<iframe src="([^"]+)"', guide.read_text(encoding="utf-8"))
    assert frames and all((guide.parent / src).resolve().is_file() for src in frames), frames
    for trace in _hooks().kept_traces():
        assert (site / "traces" / f"{_hooks().trace_name(trace)}.html").is_file(), trace.name
        assert (site / "traces" / trace.name).is_file(), trace.name
    mutants_page = (site / "reference" / "mutants" / "index.html").read_text(encoding="utf-8")
    assert all(f"<code>{m.name}</code>" in mutants_page for m in all_mutants()), "a mutant missing from the table"
    broken = (site / "guides" / "invariants-broken" / "index.html").read_text(encoding="utf-8")
    for trace in _hooks().kept_traces():
        assert f'id="{_hooks().trace_name(trace)}"' in broken and f"traces/{trace.name}" in broken
    adapter = (site / "guides" / "adapter" / "index.html").read_text(encoding="utf-8")
    assert "examples/pool_example.py</code>, line" in adapter
    recorded = json.loads(_hooks().PLUGIN_MATRIX.read_text(encoding="utf-8"))
    plugins = (site / "reference" / "findings-plugins" / "index.html").read_text(encoding="utf-8")
    assert all(row["plugin"] in plugins for row in recorded["rows"])


def test_the_strict_settings_fail_on_a_broken_link_and_a_page_out_of_the_nav(tmp_path: Path) -> None:
    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[a page that is not there](nowhere.md)\n")
    (tmp_path / "docs" / "stray.md").write_text("# A page the nav leaves out\n")
    config = {"site_name": "t", "docs_dir": "docs", "strict": ours["strict"], "validation": ours["validation"],
              "theme": {"name": ours["theme"]["name"]}, "nav": [{"Home": "index.md"}]}  # fmt: skip
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "nowhere.md" in proc.stderr and "stray.md" in proc.stderr, proc.stderr


def test_the_readme_starts_with_the_two_commands_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = next(b for b in ALL_BLOCKS if b.path.name == "README.md")
    assert [c.split("#")[0].strip() for c in first.commands()] == ["bash scripts/check.sh", "bash scripts/test.sh"]
    assert len(text.splitlines()) <= 250, "README.md is the front door: the rest goes in docs/"
    for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#([^)\s]+))?\)", text):
        path, anchor = ROOT / target[0], target[1]
        assert path.is_file(), f"README.md links to {target[0]}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
            slugs = {slugify(re.sub(r"[`*]", "", h), "-") for h in headings}
            assert anchor in slugs, f"README.md links to {target[0]}#{anchor}, which has no such heading"


def test_the_readme_names_the_releases_the_table_covers() -> None:
    # The pages generate the range (releases-covered); the README, read where no generator runs, is held to it.
    from kvspec.conformance.targets.vllm.releases import RELEASES

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"BlockPool from {RELEASES[0]} to {RELEASES[-1]}" in text


# --- what the pages say about the commands ------------------------------------------------------


def test_every_subcommand_has_a_section_in_the_commands_page() -> None:
    out = subprocess.run([_kvspec(), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    commands = re.findall(r"^    (\w[\w-]*)\s", out, re.M)
    assert len(commands) >= 10, out
    page = (DOCS / "reference" / "commands.md").read_text(encoding="utf-8")
    headings = " ".join(re.findall(r"^## (.+)$", page, re.M))
    missing = [c for c in commands if f"kvspec {c}`" not in headings]
    assert not missing, f"docs/reference/commands.md has no section for: {missing}"


def test_the_json_output_page_names_every_command_with_a_json_option() -> None:
    def with_json(parser: argparse.ArgumentParser, words: list[str]) -> Iterator[str]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from with_json(sub, [*words, name])
        if any("--json" in action.option_strings for action in parser._actions):
            yield " ".join(words)

    commands = set(with_json(build_parser(), ["kvspec"]))
    for target in ("reference", "gpu", "harness"):  # `bench` hands its arguments to each benchmark's own parser
        done = subprocess.run([_kvspec(), "bench", target, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        if "--json" in done.stdout:
            commands.add(f"kvspec bench {target}")
    assert len(commands) >= 10, commands
    page = (DOCS / "reference" / "json-output.md").read_text(encoding="utf-8")
    opening = " ".join(page.split("\n## ", 1)[0].split())
    named = set(re.findall(r"`(kvspec [\w ]+?) --json", opening))
    assert named == commands, f"docs/reference/json-output.md: missing {commands - named}, stale {named - commands}"


def test_the_json_output_page_names_exactly_the_fields_check_writes(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    argv = [_kvspec(), "check", "--impl", "spec", "--level", "pool", "--caching", "on", "--max-examples", "3",
            "--cover-rounds", "0", "--trace-dir", str(tmp_path), "--json", str(report)]  # fmt: skip
    # Three examples leave branches unreached: inconclusive (exit 2), and the report is written all the same.
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    written = json.loads(report.read_text(encoding="utf-8"))
    page = (DOCS / "reference" / "json-output.md").read_text(encoding="utf-8")
    section = page.split("## `kvspec check --json`", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert sorted(documented) == sorted(written["results"][0]), "docs/reference/json-output.md's table is stale"
    assert {"kvspec", "exit_code", "seconds", "results"} == set(written)


# --- the kept traces ----------------------------------------------------------------------------

# Runs `kvspec ARGV` for every argv of a JSON list in one process, through the function the `kvspec`
# console script calls, and prints each exit code and output.
_CLI_DRIVER = textwrap.dedent(
    """
    import contextlib, importlib, io, json, sys
    from importlib.metadata import entry_points
    (script,) = entry_points(group="console_scripts", name="kvspec")
    main = importlib.import_module(script.module).main  # in this process: the script's own runs a child
    results = []
    for argv in json.loads(sys.argv[1]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = main(argv)
        results.append([code, out.getvalue()])
    print(json.dumps(results))
    """
)


def _run_cli(argvs: list[list[str]], cwd: Path) -> list[tuple[int, str]]:
    proc = subprocess.run([sys.executable, "-c", _CLI_DRIVER, json.dumps(argvs)], cwd=cwd, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(code, out) for code, out in json.loads(proc.stdout.splitlines()[-1])]


def test_every_kept_trace_replays_to_its_rule_on_its_mutant_and_conforms_on_the_reference(tmp_path: Path) -> None:
    hooks = _hooks()
    traces = hooks.kept_traces()
    assert traces, "docs/traces/ keeps no trace: run scripts/docs-traces.sh"
    argvs: list[list[str]] = [["mutants", "--list"]]
    for t in traces:
        name, impl = hooks.trace_name(t), hooks.read_trace_lines(t)[0]["impl"]
        for side in (impl, "reference"):
            tag = "mutant" if side == impl else "reference"
            argvs.append(["replay", str(t), "--impl", side, "--trace-dir", str(tmp_path / f"{tag}-{name}"),
                          "--json", str(tmp_path / f"{name}.{tag}.json")])  # fmt: skip
    (listed, listing), *replays = _run_cli(argvs, tmp_path)
    assert listed == 0
    factories = {line.split(None, 2)[2] for line in listing.splitlines()[0::2]}
    for i, t in enumerate(traces):
        name = hooks.trace_name(t)
        header, steps, recorded = hooks.read_trace_lines(t)
        assert header["impl"] in factories, f"{t.name}: {header['impl']} is no mutant of `kvspec mutants --list`"
        (mutant_code, mutant_out), (reference_code, reference_out) = replays[2 * i], replays[2 * i + 1]
        assert mutant_code == 1, f"{t.name} on its mutant exited {mutant_code}:\n{mutant_out}"
        failure = json.loads((tmp_path / f"{name}.mutant.json").read_text())["results"][0]["failure"]
        assert failure["step"] == len(steps), f"{t.name}: diverges at step {failure['step']}, not the last"
        assert hooks.rule_broken_by(Path(failure["trace"])) == hooks.rule_broken_by(t)
        assert hooks.rule_broken_by(t)[0] == name, f"{t.name} does not show {name} broken"
        reference = json.loads((tmp_path / f"{name}.reference.json").read_text())["results"][0]
        if steps:
            assert reference_code == 0 and reference["steps"] == len(steps), f"{t.name}:\n{reference_out}"
        else:  # a pool broken once built: the reference builds, and there is no step to check
            assert reference_code == 2 and reference["verdict"] == "inconclusive", reference_out
        assert recorded is not None and recorded["verdict"] == "diverges"


@pytest.mark.vllm
def test_the_recorded_plugin_matrix_is_what_the_command_prints(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("kvspec_docs_record", ROOT / "scripts" / "docs_record.py")
    assert spec is not None and spec.loader is not None
    record = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(record)
    _, rows = record.plugin_matrix_rows(str(tmp_path))
    recorded = json.loads((DOCS / "data" / "plugin-matrix.json").read_text(encoding="utf-8"))["rows"]
    assert _matrix_facts(rows) == _matrix_facts(recorded), "run scripts/docs-plugins.sh to record the matrix again"


def _matrix_facts(rows: list[dict[str, Any]]) -> list[Any]:
    """What the page shows of the matrix: per target, each cell's verdict and finding, each probe's."""
    return [
        [row["impl"], row["plugin"], row["base"], row["profile"], row.get("error", ""),
         {k: (c["verdict"], c.get("finding")) for k, c in row.get("cells", {}).items()},
         [(p["name"], p["level"], p["caching"], p["verdict"], p.get("finding")) for p in row.get("probes", [])]]
        for row in rows
    ]  # fmt: skip
