"""One llama-server child, or a remote upstream in its place: what serves a replica
(``backend``), spawning a process that dies with the router (``spawn``), the child's
environment (``childenv``), its readiness, output and stop (``process``), and a remote
OpenAI-compatible server (``remote``).

It owns each child process and its connections. It may import ``foundation``, ``llama``,
``host``, ``config`` and ``http``.
"""
