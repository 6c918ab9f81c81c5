"""The broker page: a static single-page UI served by the plugin's app at ``/broker/ui/``.

The page (``static/index.html``, ``broker.js``, ``broker.css``: plain HTML, vanilla JS and
CSS, no build step) is listed in the Airflow UI's navigation by the plugin's
``external_views`` entry, which shows it inside Airflow's own frame. It holds no data itself:
its script calls the JSON API next to it (``/broker/api``, same origin) with the browser's
Airflow session, the ``_token`` cookie that Airflow's login sets and Airflow's ``get_user``
reads, so what the page shows and lets the user do is exactly what the API allows that user
(401 without a session, 403 for actions without edit access to the broker's connection).

Serving the files needs no login, like the Airflow UI's own assets; they are sent with
``Cache-Control: no-cache`` (a new release is picked up at once) and a Content-Security-Policy
that allows only the page's own scripts, styles and API calls, and framing by the Airflow UI
(same origin) only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

#: Where the page's files are (package data of airflow_broker.provider.plugin).
STATIC_DIR = Path(__file__).with_name("static")
#: Where the page is, inside the plugin's app (the app is mounted at /broker).
UI_PATH = "/ui"

HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "SAMEORIGIN",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'self'; base-uri 'none'; form-action 'none'"
    ),
}


class _StaticPage(StaticFiles):
    """Static files with the page's headers on every answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _v in headers}
                for name, value in HEADERS.items():
                    key = name.lower().encode("latin-1")
                    if key not in present:
                        headers.append((key, value.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await super().__call__(scope, receive, send_with_headers)


def mount_ui(app: FastAPI) -> None:
    """Serve the broker page at ``{app's mount}/ui/`` (``/ui`` redirects there)."""

    @app.get(UI_PATH, include_in_schema=False)
    def ui_without_slash() -> RedirectResponse:
        # Relative, so it holds under any prefix the API server mounts the app at.
        return RedirectResponse(url="ui/", status_code=307)

    app.mount(UI_PATH, _StaticPage(directory=STATIC_DIR, html=True), name="broker-ui")


__all__ = ["STATIC_DIR", "UI_PATH", "mount_ui"]
