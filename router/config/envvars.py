"""Environment variables of a llama-server child: the names the router keeps for itself, a
preset's ``env`` key, and what may be shown of its values.

The router keeps these names for itself; a child never takes them from the router's own
environment (``children.childenv`` removes them) nor from a preset's ``env`` (refused with
the file, line and key, ``refusal``):

* secrets (``SECRET_NAMES``, ``SECRET_PREFIXES``): API keys, TLS files, Hugging Face
  credentials. The router holds keys and downloads; a child needs none of them.
* ``AIP_*`` (``DEPLOYMENT_PREFIXES``): Vertex AI's, with which llama-server would listen on
  another port than the router gave it.
* ``LLAMA_ARG_*`` (``OPTION_PREFIX``): llama-server's options. A preset sets them as keys
  (``LLAMA_ARG_CTX_SIZE = 4096`` or ``ctx-size = 4096``), where the flag table checks them
  and ``/models`` shows them on the command line.
* ``LLAMA_SERVER_ROUTER_PORT``, ``LLAMA_SERVER_CHILD_MODE`` (``ROUTER_OWNED``): child mode,
  set by the router itself (``children.process``).
* ``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY`` (``cpus.SPIN_SETTINGS``): with CPU sharing the
  router sets the first for a child sharing its cores; set in the router's own environment,
  either one decides for every child instead.

A preset's ``env = NAME=VALUE, NAME2=VALUE2`` (``parse_env``) adds the rest to its
children's environment, over the router's (``CUDA_VISIBLE_DEVICES=1``). A value whose name
looks secret (``looks_secret``) is never logged or shown: ``ChildEnv``'s repr and ``shown``
write it ``***``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from ..host.cpus import SPIN_SETTINGS
from ..llama.flags import FlagTable

SECRET_NAMES = frozenset({"LLAMA_API_KEY", "LLAMA_ARG_API_KEY", "LLAMA_ARG_API_KEY_FILE",
                          "LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE", "HF_TOKEN",
                          "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"})
SECRET_PREFIXES = ("LLAMA_ROUTER_API_KEY",)
DEPLOYMENT_PREFIXES = ("AIP_",)
OPTION_PREFIX = "LLAMA_ARG_"
ROUTER_OWNED = frozenset({"LLAMA_SERVER_ROUTER_PORT", "LLAMA_SERVER_CHILD_MODE"})

# Parts of a name that make its value a secret to keep out of logs and answers.
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASS", "CREDENTIAL", "AUTH")
HIDDEN = "***"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A comma starts the next entry only where a ``NAME=`` follows it (a word without a comma or
# ``=``, then perhaps spaces, then ``=``), so a value keeps its own commas:
# ``CUDA_VISIBLE_DEVICES=0,1``.
_NEXT_ENTRY = re.compile(r",\s*(?=[^,=\s]*\s*=)")


def looks_secret(name: str) -> bool:
    """Whether ``name`` holds a secret by its look (``SECRET_WORDS``, in any case)."""
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def refusal(name: str, table: FlagTable | None = None) -> str | None:
    """Why a preset may not set ``name`` for its children (the module docstring's list), or
    None when it may. ``table`` names the preset key for a ``LLAMA_ARG_*`` option."""
    if name in SECRET_NAMES or name.startswith(SECRET_PREFIXES):
        return "the router keeps API keys and credentials from every child"
    if name in ROUTER_OWNED:
        return "the router sets it itself for every child (child mode)"
    if name.startswith(DEPLOYMENT_PREFIXES):
        return ("a deployment's setting that would make the child listen elsewhere than the "
                "router tells it")
    if name.startswith(OPTION_PREFIX):
        resolved = table.lookup(name) if table is not None else None
        key = f"'{resolved.option.key} = …' or " if resolved is not None else ""
        return (f"a llama-server option: set it as a preset key instead ({key}'{name} = …'), "
                "so it is checked and shown on the child's command line")
    if name in SPIN_SETTINGS:
        return ("the router sets it for CPU sharing; set it in the router's own environment "
                "to decide for every child")
    return None


class ChildEnv(Mapping[str, str]):
    """A preset's environment entries for its children (name → value), immutable; its repr
    writes a secret-looking name's value as ``***``."""

    def __init__(self, entries: Mapping[str, str] | None = None) -> None:
        self._entries = dict(entries or {})

    def __getitem__(self, name: str) -> str:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __hash__(self) -> int:
        return hash(frozenset(self._entries.items()))

    def __repr__(self) -> str:
        return f"ChildEnv({self.shown()!r})"

    def over(self, base: ChildEnv) -> ChildEnv:
        """These entries over ``base``'s, name by name (a section's over ``[*]``'s)."""
        return ChildEnv({**base._entries, **self._entries})

    def shown(self) -> dict[str, str]:
        """What logs and ``/models`` may show: every value, but ``***`` for a name that
        looks secret (``looks_secret``)."""
        return {name: HIDDEN if looks_secret(name) else value
                for name, value in self._entries.items()}


NO_ENV = ChildEnv()


def parse_env(value: str, table: FlagTable | None = None) -> ChildEnv:
    """``NAME=VALUE, NAME2=VALUE2`` → ``ChildEnv``; a comma belongs to the value unless a
    ``NAME=`` follows it. Raises ValueError naming the entry (by its place and name, never
    its value) that has no ``=``, a name that is not an environment variable's
    (``[A-Za-z_][A-Za-z0-9_]*``), a name set twice, or one the router keeps (``refusal``)."""
    if not value.strip():
        raise ValueError("expected NAME=VALUE entries, comma separated")
    entries: dict[str, str] = {}
    problems: list[str] = []
    for number, entry in enumerate(_NEXT_ENTRY.split(value.strip()), start=1):
        name, eq, text = entry.partition("=")
        name = name.strip()
        if not eq:
            problems.append(f"entry {number} has no '=': expected NAME=VALUE")
        elif not name:
            problems.append(f"entry {number} has an empty name: expected NAME=VALUE")
        elif not _NAME.fullmatch(name):
            problems.append(f"'{name}' is not an environment variable name "
                            "(letters, digits and _, not starting with a digit)")
        elif name in entries:
            problems.append(f"'{name}' is set twice")
        elif (why := refusal(name, table)) is not None:
            problems.append(f"'{name}': {why}")
        else:
            entries[name] = text.strip()
    if problems:
        raise ValueError("; ".join(problems))
    return ChildEnv(entries)
