"""Observability: the router's metrics and every child's in one exposition (``metrics``), the
GenAI semantic conventions' server span and histograms (``genai``), and the last requests it
answered with per-model totals (``activity``).

It owns the counters and the activity ring. It may import ``foundation``, ``config``,
``teams``, ``http``, ``core`` and ``warm``.
"""
