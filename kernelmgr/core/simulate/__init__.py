"""Replay a notebook workload through the real cull policy and slice allocator.

An admin choosing ``idle_timeout``, ``warn_before``, GPU sizes and the number of GPUs asks
what a policy would do *before* changing production. This package answers with the same core
code the server runs (:func:`kernelmgr.core.policy.decide`,
:class:`kernelmgr.core.allocator.SliceAllocator`, :mod:`kernelmgr.core.profiles`) on a
simulated clock:

* :mod:`.trace` — the trace format and its validation (errors name the session and field);
* :mod:`.engine` — the event loop and the accounting of the three policies compared;
* :mod:`.generate` — a synthetic trace generator with a documented model.

Pure: no file, web, traitlets or plotting here; the CLI (:mod:`kernelmgr.simulate_cli`) reads
files and configuration and draws the plot.
"""
