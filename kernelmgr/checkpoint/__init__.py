"""Checkpoints of a kernel's variables: the in-kernel agent and the on-disk format.

Everything in this package may run inside the kernel process, and imports nothing the server
runs (``tests/test_architecture.py``). Hibernating a kernel frees its GPU only if its variables
can come back: the agent (``agent``) is the IPython extension that runs inside every managed
kernel and writes its user namespace to a directory (``writer``, ``format``) and reads it back
into a fresh kernel (``reader``), where the objects live. The server finds, summarises and
removes checkpoints without unpickling anything through :mod:`kernelmgr.checkpoint_store`,
which lives outside this package because it runs in the server only.

Layout of one kernel directory, ``<root>/<owner>/<kernel_id>/``::

    current                      names the committed checkpoint (replaced atomically)
    ckpt-<time>-<hex>/           manifest.json + data.bin
    .partial-<...>/              being written; never read; removed by the next write
    quarantine/<ckpt-id>/        failed verification; kept with reason.txt for inspection
    restore-report.json          what the last restore brought back, for the server

The server imports only the format's shared modules (``layout``, ``verify``, ``integrity``,
``keys``, ``safedir``, ``progress``) and ``agent.CHECKPOINT_CODE``; ``format``, ``writer``,
``reader`` and the rest pull in the pickling machinery and are meant for the kernel process.
"""
