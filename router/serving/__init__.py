"""Serving: what runs on a model's children, and where each request runs.

What it owns: the load of each model and of each of its replicas (``load``: requests in
flight, the prompt prefixes a replica served, its pace and backlog, what its slots hold),
written by the leases alone (``leases``: a request's hold on one replica, its slot placed for
a model that keeps its conversations); the choice of a replica by prompt prefix
(``affinity``) and by expected time to first token (``pace``); and the slot queue
(``slotqueue``: a metered request's turn for a slot, in the teams' fair order). It reads a
model through ``load.Served``, which the core's record implements; the core hands down what
the leases tell it (a model idle, a replica's last request done).

It may import ``foundation``, ``config``, ``teams``, ``http``, ``children`` and ``warm``.
"""
