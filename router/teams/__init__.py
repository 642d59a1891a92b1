"""Teams: the people and agents sharing the router, told apart by their API keys.

What it owns: who a request is for (``members``: its team's name, its flow, its priority
class), the order in which a model's waiting requests get its slots (``fairshare``: priority
classes, then virtual token counters), the teams' quotas (``quotas``: requests at once,
tokens a minute) and what each team used (``usage``: kept in SQLite in the state directory).
It may import ``foundation`` and ``config`` (the key files' ``KeyPolicy``), nothing else.
"""
