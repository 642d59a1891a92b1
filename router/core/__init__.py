"""The models' core: each model's record (``runtime``) and its lifecycle as a pure transition
(``lifecycle``), carried out by ``executor``; planning and admission of loads (``scheduler``,
``admission``, ``accounting``), the way to loaded (``loader``, ``spawner``), a request's wait
for its model and a slot (``wait``), liveness and idle stops (``liveness``), CPU turns
(``cpugate``), the configured models and what a change of them means (``modelset``,
``modelchanges``), the wiring of all of these (``wiring``) and the façade the app asks
(``supervisor``, ``view``).

It owns every model's run state. It may import ``foundation``, ``llama``, ``host``,
``config``, ``teams``, ``http``, ``children``, ``warm`` and ``serving``.
"""
