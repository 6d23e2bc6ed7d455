"""The step-through player: a trace or seed 000's walkthrough as one self-contained browser page.

A trace (or the walkthrough) becomes a plain source document
(`trace_to_page_data`, `walkthrough_to_page_data`: the only code that reads
the harness's classes), then the page model (`build_view`), then one HTML
file (`render_page`). `kvspec view`, `kvspec demo --html` and `--html-dir`
of `kvspec check` / `kvspec replay` all go through here.
"""

from kvspec.conformance.tools.view.files import attach_page, page_path_for, write_trace_page
from kvspec.conformance.tools.view.model import build_view
from kvspec.conformance.tools.view.page import render_page, write_page
from kvspec.conformance.tools.view.serve import serve_page
from kvspec.conformance.tools.view.source import trace_to_page_data, walkthrough_to_page_data

__all__ = [
    "attach_page",
    "build_view",
    "page_path_for",
    "render_page",
    "serve_page",
    "trace_to_page_data",
    "walkthrough_to_page_data",
    "write_page",
    "write_trace_page",
]
