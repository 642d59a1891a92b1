"""The HTTP API: the composition of the app (``app``), the outer middleware and error handlers
(``middleware``), API keys (``keys``), CORS (``cors``), the routes the router answers itself
(``routes``), the proxy's entry (``forward``), the routing decision (``route``), a virtual
model's target (``virtual``), the keep_alive field of a request (``keepalive``), the default
model (``defaults``), a metered request's quotas,
turn and usage (``metering``), serving across nodes (``nodes``), resumable streams
(``resumable``), live reloads (``reload``), what the routes share (``state``), and Ollama's
API on the same port (``ollamaroutes``; chat, generate and embed down the proxied path:
``ollamachat``).

It owns no model state: it decides and asks. It may import ``foundation``, ``llama``,
``dashboard``, ``host``, ``config``, ``teams``, ``http``, ``children``, ``serving``,
``core``, ``peers``, ``observe`` and ``ollama``.
"""
