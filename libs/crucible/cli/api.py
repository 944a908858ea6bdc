"""The CLI's REST client: where the api is (`--api`, CRUCIBLE_API_URL) and which key it sends
(CRUCIBLE_API_KEY, or the file CRUCIBLE_API_KEY_FILE names, as `crucible up` writes to <state>/api-key).
An error answer is printed with its detail and exits 1; an api that cannot be reached exits 2."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

ApiOption = Annotated[
    str,
    typer.Option(
        "--api", help="Base URL of the Crucible API (env CRUCIBLE_API_URL).", envvar="CRUCIBLE_API_URL"
    ),
]
DEFAULT_API = os.environ.get("CRUCIBLE_API_URL", "http://127.0.0.1:8000")


def api_key() -> str | None:
    """The key from CRUCIBLE_API_KEY, else from the file CRUCIBLE_API_KEY_FILE names."""
    if key := os.environ.get("CRUCIBLE_API_KEY", "").strip():
        return key
    if path := os.environ.get("CRUCIBLE_API_KEY_FILE", "").strip():
        try:
            return Path(path).read_text().strip() or None
        except OSError as exc:
            Console(stderr=True).print(f"cannot read CRUCIBLE_API_KEY_FILE: {exc}", style="red", markup=False)
            raise typer.Exit(2) from None
    return None


def call(api: str, method: str, path: str, *, params: dict[str, Any] | None = None,
         body: dict[str, Any] | None = None) -> Any:  # fmt: skip
    """The JSON answer of `method path` on the api."""
    import httpx

    key = api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.request(method, f"{api.rstrip('/')}{path}", params=params, json=body,
                                 headers=headers, timeout=30)  # fmt: skip
    except httpx.HTTPError as exc:
        Console(stderr=True).print(f"cannot reach the API at {api}: {exc}", style="red", markup=False)
        raise typer.Exit(2) from None
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        hint = " (set CRUCIBLE_API_KEY or CRUCIBLE_API_KEY_FILE)" if response.status_code == 401 else ""
        Console(stderr=True).print(f"{response.status_code}: {detail}{hint}", style="red", markup=False)
        raise typer.Exit(1)
    return response.json()
