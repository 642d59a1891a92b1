"""The benchmark harness: what every phase shares. The targets it starts (a direct
llama-server, llama.cpp's own router mode, llama-router), the processes it owns, the timed
HTTP clients, the load generators, the statistics and the printed table.

One concept a module:

* ``columns``: the three targets compared, by key and label;
* ``errors``: ``BenchError``, what ends a run;
* ``config``: the run's configuration (``Config``) and the phases' names;
* ``processes``: the processes the harness starts, their readiness, their CPU clocks, and
  that none is left behind;
* ``targets``: starting the targets alike (``Bench``, what every phase is handed), their
  HTTP endpoints, preset files, a router's models;
* ``timing``: timed requests: bodies, retries, time to first token, streamed events;
* ``stats``: percentiles, millisecond summaries, the rotating order of the rounds;
* ``loadgen``: throughput runs (wrk or the Python generator);
* ``profiling``: py-spy and its summary;
* ``table``: the rows of a phase's table and their rendering.

The phases (``benchmarks.mainphase``, ``benchmarks.relay``, ...) and the runner
(``benchmarks.bench``) import these modules; none of them imports a phase or the runner. The
harness imports the installed ``router`` package's ``foundation``, ``llama``, ``host``,
``config`` and ``children`` parts, nothing above them.
"""
