"""Ollama's API in llama-server's terms, pure: an Ollama request translated into the
llama-server (OpenAI) request the router sends down its one request path (``translate``),
llama-server's answer translated back into Ollama's JSON or NDJSON stream (``answers``), and
what Ollama says of a model (``details``: family, size, quantization, from the GGUF header).

No I/O but reading a model's GGUF header; the routes that use it are the edge's
(``edge.ollama``). It may import ``foundation``, ``llama`` and ``config``.
"""
