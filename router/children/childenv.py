"""What a llama-server child finds in its environment.

A child inherits the router's environment, so what users set for the machine reaches it:
``CUDA_*``, ``HIP_*``, ``ROCR_*``, ``GGML_*``, ``OMP_*``, ``MTMD_BACKEND_DEVICE``, ``HOME``,
``PATH``, locale and the rest. Removed, because a child would otherwise leak them, listen
elsewhere or behave as another deployment (every name below is one llama-server b11434 reads:
``common/arg.cpp``, ``tools/server``):

* secrets (``SECRET_NAMES``, ``SECRET_PREFIXES``): API keys, TLS files, Hugging Face
  credentials. The router holds keys and downloads; a child needs none of them.
* ``AIP_*`` (Vertex AI: with ``AIP_MODE=PREDICTION``, llama-server listens on
  ``AIP_HTTP_PORT`` whatever its ``--port``, the router's own port on a prediction container,
  and adds a predict route): a child listens where the router told it, nowhere else.
* ``LLAMA_ARG_*`` inherited from the router's environment: llama-server reads each as its
  option's value unless the option is on its command line, so one would silently apply to
  every model under the presets, unseen in ``/models`` (a flag set that way cannot even be
  turned off by a preset). Per-model options come from presets only: the same names are
  preset keys (``LLAMA_ARG_CTX_SIZE = 4096`` in ``[*]`` or a section), and arguments after
  ``--`` go to every child. ``ignored`` names them so the router can warn at start.
* ``LLAMA_SERVER_ROUTER_PORT`` and ``LLAMA_SERVER_CHILD_MODE``: the router sets the first
  itself (child mode, ``process``); the second would make a child a downloader.

The names are declared once, in ``config.envvars``, which also refuses them in a preset's
``env``. The spawner puts a preset's ``env`` entries over what is left (``spawner``), so
``CUDA_VISIBLE_DEVICES`` in a preset replaces the router's for that model's children.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..config.envvars import (
    DEPLOYMENT_PREFIXES,
    OPTION_PREFIX,
    ROUTER_OWNED,
    SECRET_NAMES,
    SECRET_PREFIXES,
)


def _kept(name: str) -> bool:
    return not (name in SECRET_NAMES or name in ROUTER_OWNED
                or name.startswith((*SECRET_PREFIXES, *DEPLOYMENT_PREFIXES, OPTION_PREFIX)))


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The router's environment (``environ``: default ``os.environ``) less what the module
    docstring lists."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in env.items() if _kept(name)}


def ignored(environ: Mapping[str, str] | None = None) -> list[str]:
    """The names of the router's variables kept from children that a user may have meant
    for them (``LLAMA_ARG_*``, ``AIP_*``, the child-mode ones), sorted; secrets are not
    listed (their removal is the point)."""
    env = os.environ if environ is None else environ
    return sorted(name for name in env if not _kept(name) and name not in SECRET_NAMES
                  and not name.startswith(SECRET_PREFIXES))
