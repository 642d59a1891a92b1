"""The llama-server flag table, learned from the binary's own ``--help`` (and its build, from
``--version``).

Presets name llama-server flags by their long or short spelling without dashes (``ctx-size``,
``c``) or by their environment name (``LLAMA_ARG_CTX_SIZE``). Rather than hard-coding llama.cpp's
several hundred flags, the router runs ``llama-server --help`` once per binary (cached on disk by
path, size and mtime) and parses it, so new llama.cpp flags work without a router release.

Help format (llama.cpp ``common_arg::to_string``)::

    -c,    --ctx-size N                     size of the prompt context (default: 4096, ...)
                                            (env: LLAMA_ARG_CTX_SIZE)
    --mmap, --no-mmap                       whether to memory-map model ...
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

TRUTHY = frozenset({"on", "enabled", "true", "1", "yes"})
FALSEY = frozenset({"off", "disabled", "false", "0", "no"})

_SPELLING = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ENV = re.compile(r"\(env:\s*([A-Z0-9_]+)\)")
HELP_TIMEOUT_S = 30.0
_HELP_COLUMN = 40


@dataclass(frozen=True)
class Option:
    """One llama-server option: its spellings, environment name and whether it takes a value."""

    spellings: tuple[str, ...]
    negatives: tuple[str, ...] = ()
    env: str | None = None
    takes_value: bool = False

    @property
    def key(self) -> str:
        """Canonical preset key: the last long spelling without dashes (``ctx-size``)."""
        longs = [s for s in self.spellings if s.startswith("--")]
        return (longs[-1] if longs else self.spellings[-1]).lstrip("-")

    @property
    def flag(self) -> str:
        return "--" + self.key if any(s.startswith("--") for s in self.spellings) \
            else self.spellings[-1]

    def render(self, value: str) -> list[str]:
        """argv for this option set to ``value`` (flags: truthy → flag, falsey → negative)."""
        if self.takes_value:
            return [self.flag, value]
        if value.lower() in FALSEY:
            return [self.negatives[-1]] if self.negatives else []
        return [self.flag]


@dataclass(frozen=True)
class Resolved:
    option: Option
    negated: bool  # the key was a negative spelling (``no-mmap``) or ``LLAMA_ARG_NO_*``


class FlagTable:
    """Lookup from any preset key spelling to its Option."""

    def __init__(self, options: list[Option]) -> None:
        self.options = options
        self._by_key: dict[str, Resolved] = {}
        for opt in options:
            for spelling in opt.spellings:
                self._by_key.setdefault(spelling.lstrip("-"), Resolved(opt, False))
            for spelling in opt.negatives:
                self._by_key.setdefault(spelling.lstrip("-"), Resolved(opt, True))
            if opt.env:
                self._by_key.setdefault(opt.env, Resolved(opt, False))
                if opt.negatives and opt.env.startswith("LLAMA_ARG_"):
                    neg = "LLAMA_ARG_NO_" + opt.env.removeprefix("LLAMA_ARG_")
                    self._by_key.setdefault(neg, Resolved(opt, True))

    def lookup(self, key: str) -> Resolved | None:
        return self._by_key.get(key)

    def by_canonical(self, key: str) -> Option | None:
        found = self._by_key.get(key)
        return found.option if found else None

    def suggest(self, key: str, extra: list[str] | None = None) -> list[str]:
        names = [k for k in self._by_key if not k.isupper()] + (extra or [])
        return difflib.get_close_matches(key, names, n=3, cutoff=0.7)

    def parse_argv(self, argv: list[str]) -> list[tuple[Option, str]]:
        """Parse llama-server command-line args (``--ctx-size 512 --no-mmap``) into options."""
        out: list[tuple[Option, str]] = []
        i = 0
        while i < len(argv):
            arg = argv[i]
            name, eq, inline = arg.partition("=")
            if name.startswith("--"):  # as llama-server reads them: --n_predict is --n-predict
                name = name.replace("_", "-")
            found = self.lookup(name.lstrip("-")) if arg.startswith("-") else None
            if found is None:
                raise ValueError(f"unknown llama-server argument {arg!r}")
            if found.option.takes_value:
                if eq:
                    value = inline
                elif i + 1 < len(argv):
                    i += 1
                    value = argv[i]
                else:
                    raise ValueError(f"argument {arg!r} needs a value")
            else:
                value = "false" if found.negated else "true"
            out.append((found.option, value))
            i += 1
        return out


def parse_help(text: str) -> list[Option]:
    """Parse ``llama-server --help`` output into options."""
    options: list[Option] = []
    current: tuple[list[str], list[str], bool] | None = None
    help_text: list[str] = []

    def flush() -> None:
        if current is None:
            return
        positives, negatives, takes_value = current
        env_match = _ENV.search(" ".join(help_text))
        options.append(Option(tuple(positives), tuple(negatives),
                              env_match.group(1) if env_match else None, takes_value))

    for line in text.splitlines():
        if line.startswith("-") and not line.startswith("-----"):
            flush()
            # llama.cpp pads a spec of up to 37 columns to column 40, else breaks the line.
            if len(line) > _HELP_COLUMN and line[_HELP_COLUMN - 3:_HELP_COLUMN] == "   ":
                head, rest = line[:_HELP_COLUMN], line[_HELP_COLUMN:]
            else:
                head, rest = line, ""
            current = _parse_spec(head.strip())
            help_text = [rest]
        elif line.startswith(" ") and current is not None:
            help_text.append(line.strip())
        else:
            flush()
            current, help_text = None, []
    flush()
    return [o for o in options if o.spellings]


def _parse_spec(spec: str) -> tuple[list[str], list[str], bool]:
    spellings: list[str] = []
    takes_value = False
    for token in spec.split(","):
        token = token.strip()
        if not token:
            continue
        word, _, hint = token.partition(" ")
        if not _SPELLING.match(word):
            continue
        spellings.append(word)
        if hint.strip():
            takes_value = True
    if takes_value:
        return spellings, [], True
    # llama.cpp prints positive spellings, then negative ones (``-kvo, --kv-offload, -nkvo,
    # --no-kv-offload``): the negatives start after the last long positive spelling that
    # precedes the first ``no-`` spelling, which also catches short forms like ``-nkvo``.
    first_no = next((i for i, s in enumerate(spellings) if s.lstrip("-").startswith("no-")),
                    None)
    if first_no is None or first_no == 0:  # e.g. --no-webui alone is a positive flag
        return spellings, [], False
    last_long = max((i for i in range(first_no) if spellings[i].startswith("--")),
                    default=first_no - 1)
    positives, negatives = spellings[:last_long + 1], spellings[last_long + 1:]
    return positives, negatives, takes_value


def _cache_file(binary: Path, cache_dir: Path | None, kind: str, suffix: str) -> Path | None:
    """Where what ``binary`` said of itself is kept: one file per binary, named by its path,
    size and mtime (a rebuilt or replaced binary is asked again)."""
    if cache_dir is None:
        return None
    stat = binary.stat()
    fingerprint = f"{binary.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return cache_dir / f"{kind}-{digest}{suffix}"


def _keep(cache_file: Path, text: str) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, cache_file)


def load_build(binary: Path, cache_dir: Path | None = None) -> str:
    """``binary``'s build (``b11434``; ``unknown`` when it does not say), from the on-disk
    cache or by running ``--version``."""
    cache_file = _cache_file(binary, cache_dir, "build", ".txt")
    if cache_file is not None:
        with contextlib.suppress(OSError):
            return cache_file.read_text().strip() or "unknown"
    try:
        result = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                                timeout=HELP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"  # not kept: asked again at the next start
    build = parse_version(result.stdout + result.stderr)
    if cache_file is not None:
        with contextlib.suppress(OSError):
            _keep(cache_file, build)
    return build


def parse_version(text: str) -> str:
    """The build of llama-server's ``--version`` output (``version: 11434 (...)`` lines with
    ``(build N, ...)``), as ``bN``; ``unknown`` without one."""
    for line in text.splitlines():
        if "build" in line and "(" in line:
            build = line.split("(build", 1)[-1].split(",", 1)[0].strip()
            return f"b{build}"
    return "unknown"


def load_flag_table(binary: Path, cache_dir: Path | None = None) -> FlagTable:
    """The flag table of ``binary``, from the on-disk cache or by running ``--help``."""
    cache_file = _cache_file(binary, cache_dir, "flags", ".json")
    if cache_file is not None:
        try:
            raw = json.loads(cache_file.read_text())
            return FlagTable([Option(tuple(o["spellings"]), tuple(o["negatives"]),
                                     o["env"], o["takes_value"]) for o in raw])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    result = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                            timeout=HELP_TIMEOUT_S)
    options = parse_help(result.stdout + "\n" + result.stderr)
    if not options:
        raise RuntimeError(f"could not read the flag table from `{binary} --help` "
                           f"(exit code {result.returncode})")
    if cache_file is not None:
        _keep(cache_file, json.dumps([asdict(o) for o in options]))
    return FlagTable(options)
