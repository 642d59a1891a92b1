"""HTTP on the wire: the server protocol (``http11``), a request as the router reads it once
(``requests``, ``jsonscan`` for big bodies, ``paths`` for which paths are whose, ``tail``), the
client for the hop to an upstream (``upstream``, each connection's state in ``connstate``), the
relay of an answer (``proxy``; ``wholeanswer`` for one asked as a stream and sent whole),
server-sent events (``sse``) and the shutdown as requests see it (``shutdown``).

It owns each request's context and each upstream connection; it knows nothing of models. It
may import ``foundation``, ``llama``, ``dashboard`` (its paths), ``host``, ``config`` and
``teams`` (who a request is for).
"""
