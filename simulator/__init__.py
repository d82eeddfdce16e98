"""A fleet simulator for speculative decoding, calibrated on published figures.

* :mod:`simulator.scenario` — scenario files (YAML) and their validation;
* :mod:`simulator.engine` — the engine: one continuous batch of in-flight requests,
  each with its own arm, whose step time follows :mod:`policies.fleet`'s cost model;
  ``Engine.add(request, arm)`` admits a request, ``Engine.advance(until)`` runs steps
  and returns the finished requests with their :class:`RequestObservation`. It never
  reads a clock, so a server can drive it from wall time (``advance(now)`` on a timer)
  as well as the fast in-process mode does from simulated time;
* :mod:`simulator.run` — the fast in-process mode: closed-loop streams of one scenario
  served by one policy (``simulate``);
* :mod:`simulator.truth` — the true figures of a scenario at a moment (for the oracle);
* :mod:`simulator.generate` — random plausible scenarios for tests on unseen fleets.
"""
