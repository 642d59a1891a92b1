"""File descriptors: as many as the system allows, and never all of them for clients.

Each client connection holds one descriptor, and one more towards the child it is proxied
to; a load needs a few for the child's pipes, and each child keeps a pool of connections.
A flood of clients used to take every descriptor, so loads failed with "Too many open
files" for every request. So at start the soft limit is raised to the hard one (as nginx
and Go do; the usual soft default of 1024 is far below the hard limit), and the server
accepts at most ``connection_cap`` client connections at once: over it, a client gets a 503
envelope with ``Retry-After`` at once (``http11``), and the descriptors loads and children
need stay free.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("router.server")

RESERVED_FDS = 64  # the router's own: listening socket, log files, watchers, the HF cache
FDS_PER_MODEL = 24  # a child's pipes and the idle connections of its pool
MOST_FDS = 1 << 20  # never ask for more than this many, whatever the hard limit


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (at most ``MOST_FDS``); the soft limit
    in effect afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MOST_FDS if hard == resource.RLIM_INFINITY else min(hard, MOST_FDS)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    return MOST_FDS if soft == resource.RLIM_INFINITY else soft


def connection_cap(open_files: int, models_max: int) -> int:
    """Client connections to accept at once with ``open_files`` descriptors: two each, from
    what is left after the router's own and those of up to ``models_max`` children (<= 0:
    no model limit, counted as 8)."""
    models = models_max if models_max > 0 else 8
    return max(8, (open_files - RESERVED_FDS - FDS_PER_MODEL * models) // 2)
