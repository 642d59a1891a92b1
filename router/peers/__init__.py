"""Other routers this one fronts: each peer's state as one record (``peerstate``, applied by
``peer``), its health (``peerhealth``), its listing and events (``catalogue``), the tasks it
runs (``tasks``), the one hop to it (``hop``), which node serves a model (``placement``), all
peers together (``registry``) and what they answer together (``fleet``).

It owns what this router knows of each peer. It may import ``foundation``, ``host``,
``config``, ``teams`` (who a request is for), ``http``, ``children``, ``serving`` (prefix
keys) and ``core``.
"""
