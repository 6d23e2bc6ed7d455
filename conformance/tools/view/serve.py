"""`kvspec view --serve`: the page on a local port, until Ctrl-C.

Only 127.0.0.1 is bound, and only the one page is served (at `/`): the
page is self-contained, so nothing else is ever asked for. The server runs
in the calling thread; `serve_page` returns when it is interrupted.
"""

from __future__ import annotations

import http.server
import os
import sys
import webbrowser
from collections.abc import Callable
from typing import Any

__all__ = ["HOST", "make_server", "serve_page"]

HOST = "127.0.0.1"


def make_server(page: str, port: int = 0) -> http.server.ThreadingHTTPServer:
    """A server of `page` at `/` on 127.0.0.1:`port` (0: a free port the system picks), not yet serving."""
    body = page.encode("utf-8")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            if self.path.split("?", 1)[0].split("#", 1)[0] not in ("/", "/index.html"):
                self.send_error(404, "only the page is served here, at /")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            pass  # the URL was printed once; a log line per request says nothing more

    return http.server.ThreadingHTTPServer((HOST, port), Handler)


def _has_display() -> bool:
    """Whether a graphical browser could open: a desktop platform, or a display to draw on."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def serve_page(page: str, port: int = 0, open_browser: bool = True, announce: Callable[[str], None] = print) -> int:
    """Serve `page` on 127.0.0.1 until Ctrl-C; returns 0.

    Args:
        page: the HTML page.
        port: the port (0: a free one the system picks).
        open_browser: open the URL in a browser when there is a display to show one on
            (headless, it is only printed); a browser that cannot start is not an error.
        announce: where the URL and the stop are reported.

    Raises:
        OSError: the port cannot be bound.
    """
    server = make_server(page, port)
    url = f"http://{HOST}:{server.server_address[1]}/"
    announce(f"serving the page at {url} (Ctrl-C stops)")
    if open_browser and _has_display():
        try:
            webbrowser.open(url)
        except Exception as e:  # a browser that fails to start leaves the printed URL
            announce(f"could not open a browser ({type(e).__name__}: {e}); open {url} by hand")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    announce("stopped")
    return 0
