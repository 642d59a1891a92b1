"""Client commands against a running router: ``ls``, ``ps``, ``load``, ``unload``, ``logs``,
``events``. Human-readable tables by default, ``--json`` for scripts.

The router is found with ``--url`` or ``LLAMA_ROUTER_URL`` (default http://127.0.0.1:8080);
the API key comes from ``--api-key`` or ``LLAMA_ROUTER_API_KEY``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import httpx

from .host.memory import format_size
from .http.sse import EventTooLarge, iter_events

DEFAULT_URL = "http://127.0.0.1:8080"


class ClientError(Exception):
    """A request to the router failed; the message is for the user."""


def add_client_commands(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("LLAMA_ROUTER_URL", DEFAULT_URL),
                        help="router address (default: $LLAMA_ROUTER_URL or %(default)s)")
    common.add_argument("--api-key", default=None,
                        help="API key (default: $LLAMA_ROUTER_API_KEY)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    ls = sub.add_parser("ls", parents=[common], help="list models with status and memory")
    ls.add_argument("--cached", action="store_true",
                    help="list the GGUF models in the local Hugging Face cache (no router)")
    sub.add_parser("ps", parents=[common], help="show running llama-server children")
    for name, text in (("load", "load a model and wait until it is ready"),
                       ("unload", "stop a model's llama-server")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("model")
    logs = sub.add_parser("logs", parents=[common], help="show a model's llama-server output "
                          "(or the router's own log with no model)")
    logs.add_argument("model", nargs="?")
    logs.add_argument("-n", "--lines", type=int, default=100)
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    sub.add_parser("events", parents=[common], help="print model status events as they happen")


def run_client(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    key = args.api_key or os.environ.get("LLAMA_ROUTER_API_KEY", "").split(",")[0] or None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=args.url, headers=headers,
                          timeout=httpx.Timeout(30.0, read=None)) as client:
            return COMMANDS[args.command](client, args, out)
    except ClientError as exc:
        print(f"llama-router {args.command}: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"llama-router {args.command}: cannot reach the router at {args.url}: {exc}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text.strip() or response.reason_phrase
        raise ClientError(f"{response.status_code}: {message}")
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.json()
    return response.text


def _models(client: httpx.Client) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = _check(client.get("/models"))["data"]
    return data


def table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                  .rstrip() + "\n")


def _size(value: Any) -> str:
    return format_size(int(value)) if isinstance(value, int | float) and value else "-"


def cmd_ls(client: httpx.Client, args: argparse.Namespace, out: TextIO) -> int:
    models = _models(client)
    if args.json:
        json.dump(models, out, indent=2)
        out.write("\n")
        return 0
    rows = [["MODEL", "STATUS", "ALIASES", "MEMORY", "ESTIMATE", "SOURCE"]]
    for m in models:
        status = m["status"]
        value = status["value"] + (" (failed)" if status.get("failed") else "")
        memory = status.get("memory") or {}
        rows.append([m["id"], value, ",".join(m.get("aliases", [])) or "-",
                     _size(memory.get("measured")), _size(memory.get("estimate")),
                     m.get("source", "-")])
    table(rows, out)
    return 0


def cmd_ps(client: httpx.Client, args: argparse.Namespace, out: TextIO) -> int:
    running = []
    for m in _models(client):
        status = m["status"]
        if status["value"] in ("loading", "loaded"):
            replicas = status.get("replicas") or [
                {"pid": status.get("pid"), "port": status.get("port"),
                 "in_flight": status.get("in_flight", 0)}]
            for replica in replicas:
                running.append({"model": m["id"], "status": status["value"],
                                "pid": replica["pid"], "port": replica["port"],
                                "in_flight": replica["in_flight"],
                                "uptime_s": status.get("uptime_s"),
                                "memory": (status.get("memory") or {}).get("measured")})
    if args.json:
        json.dump(running, out, indent=2)
        out.write("\n")
        return 0
    rows = [["MODEL", "STATUS", "PID", "PORT", "UPTIME", "MEMORY", "IN-FLIGHT"]]
    for r in running:
        uptime = f"{r['uptime_s']:.0f}s" if isinstance(r["uptime_s"], int | float) else "-"
        rows.append([r["model"], r["status"], str(r["pid"]), str(r["port"]), uptime,
                     _size(r["memory"]), str(r["in_flight"])])
    table(rows, out)
    return 0


def _report(result: Any, human: str, args: argparse.Namespace, out: TextIO) -> int:
    """Print ``result`` as JSON with ``--json``, else the ``human`` line."""
    if args.json:
        json.dump(result, out)
        out.write("\n")
    else:
        out.write(human + "\n")
    return 0


def cmd_load(client: httpx.Client, args: argparse.Namespace, out: TextIO) -> int:
    started = time.monotonic()
    result = _check(client.post("/models/load", params={"wait": "true"},
                                json={"model": args.model}))
    return _report(result, f"{args.model}: loaded in {time.monotonic() - started:.2f} s",
                   args, out)


def cmd_unload(client: httpx.Client, args: argparse.Namespace, out: TextIO) -> int:
    result = _check(client.post("/models/unload", json={"model": args.model}))
    return _report(result, f"{args.model}: unloaded", args, out)


def _sse(response: httpx.Response) -> Iterator[str]:
    """The data of each event the router streams (``sse.iter_events``: an endless line
    ends the command with an error, never fills its memory)."""
    try:
        for event in iter_events(response.iter_bytes()):
            yield event.data
    except EventTooLarge as exc:
        raise ClientError(f"the router's event stream broke off: {exc}") from None


@contextlib.contextmanager
def _stream(client: httpx.Client, path: str, params: dict[str, str]
            ) -> Iterator[httpx.Response]:
    """An event stream of the router's, its error answer raised as a ``ClientError``."""
    with client.stream("GET", path, params=params) as response:
        if response.status_code >= 400:
            response.read()
            _check(response)
        yield response


def cmd_logs(client: httpx.Client, args: argparse.Namespace, out: TextIO) -> int:
    params = {"model": args.model} if args.model else {}

    def history() -> None:
        out.write(_check(client.get("/logs", params={**params, "lines": str(args.lines)})))
        out.flush()

    if not args.follow:
        history()
        return 0
    # Subscribe first, then print the history: no line falls between the two.
    with _stream(client, "/logs/stream", params) as response:
        history()
        for line in _sse(response):
            out.write(line + "\n")
            out.flush()
    return 0


def cmd_events(client: httpx.Client, args: argparse.Namespace, out: TextIO) -> int:
    with _stream(client, "/models/sse", {}) as response:
        return _print_events(_sse(response), args, out)


def _print_events(payloads: Iterator[str], args: argparse.Namespace, out: TextIO) -> int:
    for payload in payloads:
        if args.json:
            out.write(payload + "\n")
        else:
            event = json.loads(payload)
            data = event.get("data") or {}
            details = " ".join(f"{k}={v}" for k, v in data.items())
            out.write(f"{time.strftime('%H:%M:%S')} {event['model']} {event['event']} "
                      f"{details}".rstrip() + "\n")
        out.flush()
    return 0


def list_cached(as_json: bool, out: TextIO = sys.stdout) -> int:
    from .config.downloads import cached_models, hub_cache_dir

    models = cached_models()
    if as_json:
        json.dump([{"id": mid, "files": [str(p) for p in paths], "bytes": size}
                   for mid, paths, size in models], out, indent=2)
        out.write("\n")
        return 0
    if not models:
        out.write(f"no GGUF models in {hub_cache_dir()}\n")
        return 0
    table([["MODEL", "SIZE", "FILE"]] + [[mid, format_size(size), str(paths[0])]
                                         for mid, paths, size in models], out)
    return 0


def pull(model: str, hf_file: str | None = None, out: TextIO = sys.stderr) -> int:
    """Download a model with a progress line per file; usable without a running router."""
    from .config.downloads import HfRef, HubUnreachable, ResolveError, download, resolve_remote

    try:
        resolution = resolve_remote(HfRef.parse(model), hf_file)
    except (ResolveError, HubUnreachable) as exc:
        print(f"llama-router pull: {exc}", file=out)
        return 1
    print(f"{resolution.id}: {len(resolution.files)} file(s), "
          f"{format_size(resolution.total_bytes)}", file=out)

    def progress(name: str, done: int, total: int | None) -> None:
        share = f"{100 * done / total:5.1f}%" if total else ""
        out.write(f"\r  {name}  {format_size(done)} / {_size(total)}  {share}")
        if total is not None and done >= total:
            out.write("\n")
        out.flush()

    try:
        paths = download(resolution, progress)
    except (ResolveError, OSError) as exc:
        print(f"\nllama-router pull: {exc}", file=out)
        return 1
    except KeyboardInterrupt:
        print("\nllama-router pull: interrupted", file=out)
        return 130
    print(f"done: {paths[0]}", file=out)
    return 0


COMMANDS = {"ls": cmd_ls, "ps": cmd_ps, "load": cmd_load, "unload": cmd_unload,
            "logs": cmd_logs, "events": cmd_events}
