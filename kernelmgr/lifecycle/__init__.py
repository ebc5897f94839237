"""The elastic lifecycle inside the server process: hibernate, resume, loss and recovery.

:mod:`kernelmgr.core.controller` orders every operation; this package supplies what it acts
on (:mod:`.platform`, a kernel's processes through jupyter_client), the facade the server calls
(:mod:`.service`), what happens when a kernel vanishes (:mod:`.loss`) or a previous server left
kernels behind (:mod:`.recovery`), and the records, metrics and events of it all. It reaches
jupyter_server only through :class:`.host.KernelHost`, and imports no web or Kubernetes
framework (tests/test_architecture.py).
"""
