"""Pages beside failure traces: what `--html-dir` of `kvspec check` and `kvspec replay` writes.

A failure's page is named after its trace (`failure-pool-3f2a91.trace.jsonl`
gives `failure-pool-3f2a91.html`) and its path is appended to the failure's
story, so the printed summary and the JUnit failure text both carry it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvspec.conformance.core.files import shown
from kvspec.conformance.core.results import CheckResult
from kvspec.conformance.core.trace import MalformedTrace, read_trace
from kvspec.conformance.tools.view.page import write_page
from kvspec.conformance.tools.view.source import trace_to_page_data

__all__ = ["attach_page", "page_path_for", "write_trace_page"]

_TRACE_SUFFIX = ".trace.jsonl"


def page_path_for(trace_path: str | Path, html_dir: str | Path) -> Path:
    """Where the page of `trace_path` goes in `html_dir`: the trace's name, ending in .html.

    >>> str(page_path_for("t/failure-pool-3f2a91.trace.jsonl", "reports"))
    'reports/failure-pool-3f2a91.html'
    """
    name = Path(trace_path).name
    stem = name[: -len(_TRACE_SUFFIX)] if name.endswith(_TRACE_SUFFIX) else Path(name).stem
    return Path(html_dir) / f"{stem}.html"


def write_trace_page(trace_path: str | Path, html_dir: str | Path) -> Path:
    """Read a trace file and write its page into `html_dir`; returns the page's path.

    Raises:
        MalformedTrace: the trace cannot be read.
        OSError: the page cannot be written.
    """
    return write_page(page_path_for(trace_path, html_dir), trace_to_page_data(read_trace(trace_path)))


def attach_page(result: CheckResult, html_dir: str | Path | None, folder: Path | None = None) -> Path | None:
    """Write the page of `result`'s failure trace into `html_dir` and name it in the failure's story (relative
    to `folder`, the one the run started in, where it lies inside).

    Does nothing (returns None) without a directory, a failure or a trace. A
    page that cannot be written is reported in the story instead: the verdict
    stands either way.
    """
    failure = result.failure
    if html_dir is None or failure is None or failure.trace_path is None:
        return None
    try:
        page = write_trace_page(failure.trace_path, html_dir)
    except (MalformedTrace, OSError, ValueError) as e:
        result.failure = replace(failure, story=failure.story + f"\npage: not written ({type(e).__name__}: {e})")
        return None
    named = page if folder is None else shown(page, folder)
    result.failure = replace(failure, story=failure.story + f"\npage: {named}")
    return page
