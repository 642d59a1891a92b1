"""The floor for a router's start and memory in Python: the product's fixed dependencies
(pydantic-settings, httpx, starlette on uvicorn with uvloop and httptools) serving ``/health``
and nothing else.

The main phase starts it beside the routers: its start -> ``/health`` 200 and idle RSS are
what any router built on these dependencies pays before its own code, so llama-router's
figures above it are what its own modules add::

    python -m benchmarks.floorstart PORT
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from pydantic_settings import BaseSettings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class FloorSettings(BaseSettings):
    host: str = "127.0.0.1"
    port: int = 8080


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with httpx.AsyncClient(trust_env=False, verify=False):  # as the router's children's
        yield


def main() -> None:
    settings = FloorSettings(port=int(sys.argv[1]))
    app = Starlette(routes=[Route("/health", health)], lifespan=lifespan)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning",
                loop="uvloop", http="httptools", ws="none", access_log=False)


if __name__ == "__main__":
    main()
