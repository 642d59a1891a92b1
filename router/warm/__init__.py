"""Warm swaps: the router's directory of saved slot states (``statestore``), the digests of
the files a KV cache depends on (``digests``, ``weights``), what is worth saving and where it
goes back (``choice``, pure), what is asked of a child's slots (``slots``), the saving and
restoring of a model's slots around a stop and a load (``swaps``), and every conversation's
cache kept across slot churn: what each slot holds (``slotbook``) and a request's slot
prepared (``conversations``).

It owns the saved states on disk and their counters. It sees a model's replicas only as the
children and prefix keys it is handed (``swaps.SlotHolder``). It may import ``foundation``,
``llama``, ``host``, ``config`` and ``children``.
"""
