"""Restore imports slow libraries while ``data.bin`` is read, without weakening integrity.

The reader starts importing the libraries a checkpoint was saved with (torch, in the product)
on a thread as soon as the manifest is verified, so the import overlaps the read; see
``kernelmgr.checkpoint.reader._prewarm``. A probe module stands in for torch here (CI has no
GPU, and torch may already be imported): saved with it loaded, removed from ``sys.modules``
before the restore, it records which thread imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kernelmgr.checkpoint import reader, writer
from kernelmgr.checkpoint.errors import CheckpointRefused
from tests.test_checkpoint_format import KERNEL, OWNER, Marker, load, save

pytestmark = pytest.mark.pure

PROBE = "elastic_prewarm_probe"
PROBE_SOURCE = """
import threading, time
from pathlib import Path
Path(__file__).with_name("imported-by.txt").write_text(threading.current_thread().name)
time.sleep(0.2)  # a slow import, as torch's is
__version__ = "1.0"
"""


@pytest.fixture
def kdir(tmp_path: Path) -> Path:
    return tmp_path / OWNER / KERNEL


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The probe library: importable, in the writer's and the reader's lists; yields its log."""
    folder = tmp_path / "probe"
    folder.mkdir()
    (folder / f"{PROBE}.py").write_text(PROBE_SOURCE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(writer, "LIBRARIES", (*writer.LIBRARIES, PROBE))
    monkeypatch.setattr(reader, "PREWARM_LIBRARIES", (PROBE,))
    __import__(PROBE)
    yield folder / "imported-by.txt"
    sys.modules.pop(PROBE, None)


def test_restore_prewarms_the_saved_libraries_and_restores_the_same_values(kdir: Path, probe: Path) -> None:
    array = np.arange(3 << 20, dtype=np.float64)  # 24 MiB: several digest chunks
    manifest = save(kdir, {"a": array, "meta": {"k": [1, 2]}})
    assert manifest.libraries[PROBE] == "1.0"
    sys.modules.pop(PROBE)
    probe.unlink()
    ns, report = load(kdir)
    assert probe.read_text() == "checkpoint-prewarm", "the library was not imported on the prewarm thread"
    assert PROBE in sys.modules
    np.testing.assert_array_equal(ns["a"], array)
    assert ns["meta"] == {"k": [1, 2]}
    timings = report["timings"]
    assert set(timings) == {"verify_manifest", "read_and_digest", "import_wait", "unpickle"}
    assert all(value >= 0 for value in timings.values())


def test_nothing_is_prewarmed_when_the_library_is_already_loaded(kdir: Path, probe: Path) -> None:
    save(kdir, {"x": 1})
    probe.unlink()
    ns, report = load(kdir)
    assert not probe.exists() and ns["x"] == 1 and report["timings"]["import_wait"] < 0.1


@pytest.mark.parametrize("where", [-3, 4096])
def test_a_corrupted_chunk_is_refused_before_unpickling_while_prewarming(
    kdir: Path, probe: Path, tmp_path: Path, where: int
) -> None:
    evidence = tmp_path / "unpickled.txt"
    manifest = save(kdir, {"marker": Marker(evidence), "a": np.ones(2 << 20)})
    sys.modules.pop(PROBE)
    data = kdir / manifest.checkpoint_id / "data.bin"
    content = bytearray(data.read_bytes())
    content[where] ^= 0xFF
    data.write_bytes(content)
    with pytest.raises(CheckpointRefused, match="does not match the manifest's digest"):
        load(kdir)
    assert not evidence.exists(), "something was unpickled from a corrupted checkpoint"
    assert (kdir / "quarantine" / manifest.checkpoint_id / "data.bin").exists()
