"""The checkpoint format: one place to read how a checkpoint looks and how it is made.

A checkpoint of a kernel's variables is a directory ``ckpt-<UTC time>-<8 hex>/`` in the
kernel directory (see :mod:`kernelmgr.checkpoint.layout`) holding two files:

``data.bin``
    For each *group* of variables (variables that share objects; see
    :mod:`~kernelmgr.checkpoint.grouping`), in order: one pickle stream (protocol 5) of
    ``{name: value}``, then that stream's out-of-band buffers (numpy arrays, pandas blocks,
    torch storages), each starting at a multiple of 64 bytes. Raw bytes, no container
    format: written straight from the objects' memory and read straight into the buffers
    the restored objects use.

``manifest.json``
    :class:`kernelmgr.core.manifest.Manifest`: every variable (saved in which group, or
    skipped and why), each group's offsets into ``data.bin``, Python and library versions,
    totals, timings, a SHA-256-based digest of ``data.bin``, and an HMAC under the owner's key over
    all of it (:mod:`~kernelmgr.checkpoint.integrity`).

The commit protocol (:func:`write_checkpoint`): both files are written into
``.partial-<id>/`` and fsynced, the directory is fsynced and renamed to ``<id>/``, the
kernel directory is fsynced, ``current`` is replaced atomically to name ``<id>``, and only
then are older checkpoints deleted. A crash at any point leaves ``current`` naming either
the old checkpoint or the new one, each complete.

Reading (:func:`restore_checkpoint`) verifies the manifest and the data digest before
unpickling anything, and moves a checkpoint that fails to ``quarantine/``.
"""

from __future__ import annotations

from kernelmgr.checkpoint.errors import CheckpointFailed, CheckpointRefused
from kernelmgr.checkpoint.layout import ALIGN
from kernelmgr.checkpoint.reader import read_payload, refused_report, restore_checkpoint
from kernelmgr.checkpoint.serialize import remap_device
from kernelmgr.checkpoint.verify import load_verified_manifest
from kernelmgr.checkpoint.writer import WriteFn, is_machinery, write_checkpoint

__all__ = [
    "ALIGN",
    "CheckpointFailed",
    "CheckpointRefused",
    "WriteFn",
    "is_machinery",
    "load_verified_manifest",
    "read_payload",
    "refused_report",
    "remap_device",
    "restore_checkpoint",
    "write_checkpoint",
]
