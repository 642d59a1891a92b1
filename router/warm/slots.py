"""What warm swaps ask of a child about its slots, over HTTP: the slots it has, how fast it
computes prompts, and a slot's save or restore. Every call closes its connection and none
raises: a child that cannot answer answers nothing."""

from __future__ import annotations

from typing import Any

import httpx

from ..children.backend import Backend

LISTING_TIMEOUT_S = 5.0  # GET /slots, GET /metrics
# Every request to a child closes its connection: one left idle in the shared client's pool
# holds up the child's exit when it is stopped (llama-server waits on open connections; a
# save before a stop made the stop ~100 ms slower).
ONE_SHOT = {"connection": "close"}


class SlotEndpoints:
    """The slot endpoints of the children, through one shared client."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def slots(self, child: Backend) -> list[dict[str, Any]]:
        """The child's slots (``GET /slots``); none when it has no such endpoint."""
        try:
            response = await self._client.get(f"{child.base_url}/slots",
                                              timeout=LISTING_TIMEOUT_S, headers=ONE_SHOT)
            listing = response.json() if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return []
        return [s for s in listing if isinstance(s, dict) and isinstance(s.get("id"), int)
                and not isinstance(s.get("id"), bool)] if isinstance(listing, list) else []

    async def prompt_speed(self, child: Backend) -> float | None:
        """The child's average prompt speed in tokens a second (its ``/metrics``), if any."""
        try:
            response = await self._client.get(f"{child.base_url}/metrics",
                                              timeout=LISTING_TIMEOUT_S, headers=ONE_SHOT)
        except httpx.HTTPError:
            return None
        return _speed(response.text) if response.status_code == 200 else None

    async def action(self, child: Backend, slot: int, action: str, filename: str
                      ) -> dict[str, Any] | None:
        """The child's answer to ``POST /slots/{slot}?action=...``, or None if it failed."""
        try:
            response = await self._client.post(
                f"{child.base_url}/slots/{slot}", params={"action": action},
                json={"filename": filename}, headers=ONE_SHOT,
                timeout=None)  # bounded by the caller
            answer = response.json()
        except (httpx.HTTPError, ValueError):
            return None
        return answer if response.status_code == 200 and isinstance(answer, dict) else None


def _speed(metrics: str) -> float | None:
    """A child's average prompt speed in tokens a second, from its ``/metrics`` text."""
    for line in metrics.splitlines():
        if line.startswith("llamacpp:prompt_tokens_seconds "):
            try:
                value = float(line.split()[1])
            except (IndexError, ValueError):
                return None
            return value if value > 0 and value != float("inf") else None
    return None
