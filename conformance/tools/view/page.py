"""The player page: one self-contained HTML file per trace or walkthrough.

The page is `player.html` (its CSS and script inline) with the page model
(`build_view`) embedded as JSON, so it opens from `file://`, needs no
network, no CDN and no web font, and can be attached to a CI run as it is.

Design choice: the data travels as one JSON block the script reads, rather
than as pre-rendered HTML for every step. A step's state is a few hundred
bytes of JSON, where its drawn form would be tens of kilobytes, so a
50-step trace of a 24-block pool stays far below a megabyte.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from kvspec.conformance.core.files import write_whole
from kvspec.conformance.tools.view.model import build_view

__all__ = ["render_page", "write_page"]


def _template() -> str:
    return resources.files("kvspec.conformance.tools.view").joinpath("player.html").read_text(encoding="utf-8")


def render_page(doc: Mapping[str, Any]) -> str:
    """The HTML page for a source document (`trace_to_page_data`, `walkthrough_to_page_data`).

    Args:
        doc: the source document.

    Returns:
        The whole page, every byte of it inline.
    """
    view = build_view(doc)
    # Every "<" escaped, so no string in the data can close the script element.
    payload = json.dumps(view, separators=(",", ":"), ensure_ascii=True).replace("<", "\\u003c")
    page = _template()
    return page.replace("__KVSPEC_TITLE__", html.escape(str(view["title"]))).replace("__KVSPEC_DATA__", payload)


def write_page(path: str | Path, doc: Mapping[str, Any]) -> Path:
    """Write the page for `doc` to `path` (parents created), whole or not at all; returns the path.

    Raises:
        OSError: it cannot be written.
    """
    return write_whole(path, render_page(doc))
