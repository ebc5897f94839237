"""Checkpoints of a kernel's variables: the on-disk format, the server's store, the in-kernel agent.

Hibernating a kernel frees its GPU only if its variables can come back. This package writes
a kernel's user namespace to a directory (``format``), reads it back into a fresh kernel,
and lets the server find, summarise and remove checkpoints (``store``) without unpickling
anything. The agent (``agent``) is the IPython extension that runs inside every managed
kernel and does the writing and reading there, where the objects live.

Layout of one kernel directory, ``<root>/<owner>/<kernel_id>/``::

    current                      names the committed checkpoint (replaced atomically)
    ckpt-<time>-<hex>/           manifest.json + data.bin
    .partial-<...>/              being written; never read; removed by the next write
    quarantine/<ckpt-id>/        failed verification; kept with reason.txt for inspection
    restore-report.json          what the last restore brought back, for the server

Only ``integrity`` and ``store`` are imported by the server; ``format`` and ``agent`` pull
in the pickling machinery and are meant for the kernel process.
"""
