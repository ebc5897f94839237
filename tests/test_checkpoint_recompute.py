"""The cell record and recompute on resume, in real IPython shells (as in test_checkpoint_agent).

Each test hibernates (the server's silent checkpoint) and resumes in a *fresh* shell on the
same kernel directory, several times: the record must continue, and what pickle cannot save
(a generator, a lock, an open file and a lambda over it, a buffered stream) must come back by
re-running the cells that made it, while a cell with a side effect must not run twice.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from kernelmgr.checkpoint import agent
from kernelmgr.checkpoint.cells import CellRecord, analyze, plan_recompute
from kernelmgr.checkpoint.layout import read_current
from kernelmgr.checkpoint_store import CheckpointStore
from tests.test_checkpoint_agent import (
    CHECKPOINT_CODE,
    KERNEL,
    OWNER,
    SECRET,
    agent_env,
    displayed,
    new_shell,
    run,
)
from tests.test_checkpoint_agent import isolate as isolate  # autouse fixture: put __main__ back

pytestmark = pytest.mark.pure


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "checkpoints", SECRET)


def hibernate_and_resume(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, shell: Any) -> Any:
    result = shell.run_cell(CHECKPOINT_CODE, silent=True)
    assert result.success, result.error_in_exec
    return new_shell(monkeypatch, agent_env(store, restore=True))


def report() -> dict[str, Any]:
    found = agent.last_restore_report()
    assert found is not None
    return found


def why_not(name: str) -> str:
    [item] = [item for item in report()["not_restored"] if item["name"] == name]
    return str(item.get("not_recomputed", ""))


# -- the static analysis ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "unsafe"),
    [
        ("x = open(p).read()", None),
        ("with open(p, 'rb') as f:\n    data = f.read()", None),
        ("f = open(p, 'w')", "opens a file for writing"),
        ("f = open(p, mode=m)", "opens a file for writing"),
        ("import subprocess\nsubprocess.run(['ls'])", "imports subprocess"),
        ("from socket import socket", "imports socket"),
        ("import os\nos.system('ls')", "calls os.system"),
        ("import os\nos.remove(p)", "calls os.remove"),
        ("df.to_csv('out.csv')", "calls .to_csv()"),
        ("Path(p).write_text('x')", "calls .write_text()"),
        ("name = input()", "asks for input()"),
        ("exec('y = 1')", "uses exec()"),
        ("globals()['y'] = 1", "uses globals()"),
        ("get_ipython().system('ls')", "uses a magic or shell escape"),
        ("def f():\n    open(p, 'a').write('x')", "opens a file for writing"),
        ("stamp = time.time()", "calls time.time()"),
    ],
)
def test_the_safety_rule(source: str, unsafe: str | None) -> None:
    found = analyze(source)
    if unsafe is None:
        assert found.unsafe == []
    else:
        assert any(why.startswith(unsafe) for why in found.unsafe), found.unsafe


def test_reads_writes_and_in_place_changes() -> None:
    found = analyze(
        "import numpy as np\n"
        "total = sum(xs) + offset\n"
        "def f(a):\n    b = a + scale\n    return b\n"
        "items.append(total)\nconfig['k'] = 1\ncount += 1\n"
        "squares = [i * i for i in xs]\n"
    )
    assert {"xs", "offset", "scale", "items", "config", "count", "np"} <= found.reads | {"np"}
    assert "a" not in found.reads and "b" not in found.reads and "sum" not in found.reads
    assert {"np", "total", "f", "squares"} <= found.writes
    assert found.mutates == {"items", "config", "count"}
    assert analyze("import random\nv = random.random()").random
    seeded = analyze("import random\nrandom.seed(1)\nv = random.random()")
    assert seeded.random and seeded.seeds
    assert analyze("import numpy as np\nrng = np.random.default_rng(0)").seeds


def test_the_plan_takes_the_version_a_cell_saw() -> None:
    def cell(index: int, reads: list[str], writes: list[str], **kw: Any) -> CellRecord:
        return CellRecord(index=index, source="", reads=reads, writes=writes, **kw)

    cells = [
        cell(1, [], ["x"]),
        cell(2, ["x"], ["g"]),
        cell(3, [], ["x"]),
        cell(4, ["g"], ["h"]),
        cell(5, [], ["u"], unsafe=["opens a file for writing"]),
        cell(6, ["u"], ["v"]),
    ]
    plan = plan_recompute(cells, ["g", "h", "v"], ["x"])
    assert [c.index for c in plan.cells] == [1, 2, 4]  # x as cell 2 saw it came from cell 1
    assert plan.targets == ["g", "h"]
    assert plan.impossible == {"v": "cell 5 opens a file for writing"}
    # Without cell 3, the restored x is the version cell 2 saw: cell 1 is not needed.
    assert [c.index for c in plan_recompute(cells[:2], ["g"], ["x"]).cells] == [2]
    assert plan_recompute(cells, ["w"], ["x"]).impossible == {"w": "no recorded cell wrote w"}


# -- recompute on resume, in real shells ------------------------------------------------------


def test_unsaveable_variables_come_back_across_hibernations(
    store: CheckpointStore,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "data.txt"
    data.write_text("first\nsecond\n")
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, f"path = {str(data)!r}\nnums = [1, 2, 3]")
    run(shell, "import threading\nlock = threading.Lock()")
    run(shell, "gen = (n * n for n in nums)")
    run(shell, "fh = open(path)\nread_line = lambda: fh.readline().strip()")
    run(shell, "import io\nstream = io.BufferedReader(io.BytesIO(b'payload'))")
    run(shell, "print('LOUD')\nnoisy = threading.Event()")
    run(shell, "lines = (line.strip() for line in open(path))")
    # fh and read_line are saved (the file reducer reopens it); the rest cannot be pickled.
    rebuilt = {"lock", "gen", "stream", "noisy", "lines"}
    assert "LOUD" in capsys.readouterr().out

    for cycle in range(3):
        shell = hibernate_and_resume(store, monkeypatch, shell)
        ns = shell.user_ns
        assert {item["name"] for item in report()["recomputed"]} == rebuilt
        assert report()["not_restored"] == []
        assert isinstance(ns["lock"], type(threading.Lock())) and ns["lock"].acquire(blocking=False)
        assert list(ns["gen"]) == [1, 4, 9]
        if cycle == 0:  # restored (by the file reducer), with the position it had
            assert ns["read_line"]() == "first"
        assert ns["stream"].read() == b"payload" and list(ns["lines"]) == ["first", "second"]
        assert ns["nums"] == [1, 2, 3]  # restored, untouched by the replay
        run(shell, f"step{cycle} = {cycle}")
        [shown] = displayed(shell)
        assert "Recomputed (re-ran 5 cells): " in shown["text/plain"], shown
        assert "LOUD" not in capsys.readouterr().out  # the replay printed nothing
        # The history continues: every cell of every cycle, numbered on.
        records = agent._AGENT.cells if agent._AGENT else []
        assert [c.index for c in records] == list(range(1, 9 + cycle))
        assert records[-1].writes == [f"step{cycle}"]
    written = store.restore_report(OWNER, KERNEL)
    assert written is not None and written["recomputed"] == report()["recomputed"]
    assert {f"step{c}" for c in range(2)} <= set(written["restored"])


def test_an_unsafe_cell_is_not_rerun(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = tmp_path / "log.txt"
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "import threading")
    run(shell, f"with open({str(log)!r}, 'a') as out:\n    out.write('ran ')\nlock = threading.Lock()")
    run(shell, "import random\nunseeded = (v for v in [random.random()])")
    run(shell, "random.seed(7)\nseeded = (v for v in [random.random()])")
    run(shell, "!echo hi\nmagic = threading.Lock()")
    expected = next(shell.user_ns["seeded"])
    for cycle in range(3):
        shell = hibernate_and_resume(store, monkeypatch, shell)
        assert log.read_text() == "ran "  # the side effect happened once
        assert not {"lock", "unseeded", "magic"} & set(shell.user_ns)
        if cycle == 0:  # later checkpoints no longer hold the names that did not come back
            assert "opens a file for writing" in why_not("lock")
            assert "without a seed" in why_not("unseeded")
            assert "magic or shell escape" in why_not("magic")
            assert report()["not_restored"][0]["stage"] == "save"
        assert [item["name"] for item in report()["recomputed"]] == ["seeded"]
        assert next(shell.user_ns["seeded"]) == expected


def test_a_replay_never_changes_what_was_restored(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "x = 1")
    run(shell, "items = [0]\nitems.append(1)")
    run(shell, "g = (v for v in [x])")
    run(shell, "x = 2\nh = (v for v in items)\nitems.append(2)")
    resumed = hibernate_and_resume(store, monkeypatch, shell)
    ns = resumed.user_ns
    assert ns["x"] == 2 and next(ns["g"]) == 1  # g rebuilt from x as it was, x kept
    assert ns["items"] == [0, 1, 2]  # the cell that appends was not re-run
    assert "h" not in ns and "changes items in place" in why_not("h")


def test_replay_is_bounded_by_a_time_limit(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flag = tmp_path / "go"
    flag.touch()
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, f"import os, threading, time\nflag = {str(flag)!r}")
    run(shell, "while not os.path.exists(flag):\n    pass\nwaits = threading.Lock()")
    flag.unlink()  # the replay of that cell now spins
    monkeypatch.setenv(agent.ENV_RECOMPUTE_SECONDS, "0.5")
    resumed = hibernate_and_resume(store, monkeypatch, shell)
    assert "waits" not in resumed.user_ns and "took over 0.5 s" in why_not("waits")
    assert resumed.user_ns["flag"] == str(flag)  # a rolled-back replay leaves the rest alone

    run(resumed, "time.sleep(0.6)\nslow = threading.Lock()")
    again = hibernate_and_resume(store, monkeypatch, resumed)
    assert "slow" not in again.user_ns and "over the 0.5 s limit" in why_not("slow")  # not even started

    run(again, "off = threading.Lock()")
    monkeypatch.setenv(agent.ENV_RECOMPUTE_SECONDS, "0")
    hibernate_and_resume(store, monkeypatch, again)
    assert "recompute is off" in why_not("off") and report()["recomputed"] == []
    json.dumps(report())


def test_a_tampered_cell_record_is_refused_and_never_run(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The record's sources are executed on resume: the manifest's HMAC must cover them."""
    marker = tmp_path / "pwned"
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "import threading\nlock = threading.Lock()")
    assert shell.run_cell(CHECKPOINT_CODE, silent=True).success
    directory = store.kernel_dir(OWNER, KERNEL)
    manifest_path = directory / read_current(directory) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["cells"][0]["source"] = f"open({str(marker)!r}, 'w')\nimport threading\nlock = threading.Lock()"
    manifest_path.write_text(json.dumps(manifest))
    resumed = new_shell(monkeypatch, agent_env(store, restore=True))
    assert report()["refused"] and "lock" not in resumed.user_ns
    assert not marker.exists()


def test_a_variable_that_fails_to_load_is_recomputed(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    shell = new_shell(monkeypatch, agent_env(store, restore=False))
    run(shell, "calls = []")
    run(
        shell,
        "def fail_on_load():\n    raise RuntimeError('cannot come back')\n"
        "class Fragile:\n    def __reduce__(self):\n        return (fail_on_load, ())\n",
    )
    run(shell, "fragile = Fragile()")
    resumed = hibernate_and_resume(store, monkeypatch, shell)
    [item] = report()["recomputed"]
    assert item["name"] == "fragile" and item["stage"] == "load", item
    assert "could not be loaded: RuntimeError: cannot come back" in item["reason"]
    assert type(resumed.user_ns["fragile"]).__name__ == "Fragile"
    assert report()["not_restored"] == []
