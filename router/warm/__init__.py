"""Warm swaps: the router's directory of saved slot states (``statestore``), the digests of
the files a KV cache depends on (``digests``, ``weights``), and the saving and restoring of a
model's slots around a stop and a load (``swaps``).

It owns the saved states on disk and their counters. It sees a model's replicas only as the
children and prefix keys it is handed (``swaps.SlotHolder``). It may import ``foundation``,
``llama``, ``host``, ``config`` and ``children``.
"""
