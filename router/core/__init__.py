"""The models' core: each model's record (``runtime``) and its lifecycle as a pure transition
(``lifecycle``), carried out by ``executor``; planning and admission of loads (``scheduler``,
``admission``, ``accounting``), the way to loaded (``loader``, ``spawner``), the hot path's
leases and waits (``leases``, ``wait``, ``affinity``, ``pace``), liveness, idle stops and CPU
turns (``liveness``, ``idle``, ``cpugate``), the configured models (``modelset``), the wiring of
all of these (``wiring``) and the façade the app asks (``supervisor``, ``view``).

It owns every model's run state. It may import ``foundation``, ``llama``, ``host``,
``config``, ``teams``, ``http``, ``children`` and ``warm``.
"""
