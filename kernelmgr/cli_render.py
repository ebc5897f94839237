"""What ``jupyter elastic`` prints: plain-text tables of the REST API's JSON models."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from kernelmgr import cli_colour
from kernelmgr.cli_refs import SHORT_ID, shorten_path
from kernelmgr.core.units import human_bytes

MIB = 1024 * 1024


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    paint: Mapping[int, Callable[[str], str]] | None = None,
) -> str:
    """Left-aligned columns, two spaces apart; ``-`` for missing values. ``paint`` colours the
    cells of some columns (by index); widths are those of the plain text."""
    cells = [[("-" if value in (None, "") else str(value)) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    painters = paint or {}

    def cell(index: int, text: str, width: int) -> str:
        painter = painters.get(index)
        return painter(text) + " " * (width - len(text)) if painter else text.ljust(width)

    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(cell(i, c, w) for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
        for row in cells
    ]
    return "\n".join(lines)


def human_mib(mib: Any) -> str:
    """A size the API gives in MiB, as :func:`human_bytes` writes it."""
    return "-" if mib is None else human_bytes(float(mib) * MIB)


def _fraction(value: Any) -> str:
    if value is None:
        return "-"
    return f"{int(value)} GPU" if value >= 1 else f"{value:.0%}"


def _isolation(isolation: dict[str, Any] | None) -> str:
    """``hard/soft``: what the platform enforces for the size's memory and compute (``-`` if unknown)."""
    if not isolation:
        return "-"
    return f"{isolation.get('memory', '?')}/{isolation.get('compute', '?')}"


def render_profiles(doc: dict[str, Any]) -> str:
    rows = [
        [
            p["name"],
            p["display_name"],
            _fraction(p["gpu_fraction"]),
            human_mib(p["memory_mib"]),
            p["backend"],
            _isolation(p.get("isolation")),
            "yes" if p.get("fits_now") else "no",
            ", ".join(p.get("kernelspecs", [])),
        ]
        for p in doc.get("profiles", [])
    ]
    headers = [
        "SIZE",
        "DISPLAY NAME",
        "GPU",
        "MEMORY",
        "BACKEND",
        "ENFORCED MEM/COMPUTE",
        "FITS NOW",
        "KERNELSPECS",
    ]
    out = table(headers, rows)
    if not doc.get("gpus_available", True):
        out += f"\n\n{doc.get('message', 'No GPUs.')}"
    return out


def render_gpus(doc: dict[str, Any]) -> str:
    def holders(slices: list[dict[str, Any]], others: dict[str, Any] | None) -> str:
        """Which kernels hold slices (short ids, as JupyterLab shows them, with their size)."""
        warm = sum(1 for s in slices if s.get("warm"))
        held = [f"{str(s['kernel_id'])[:8]} ({s.get('profile') or '-'})" for s in slices if not s.get("warm")]
        if others and others.get("slices"):  # a gateway user: other users' slices, counted only
            held.append(f"+{others['slices']} of other users")
        if warm:
            held.append(f"+{warm} warm")
        return ", ".join(held) or "-"

    rows = [
        [
            d["index"],
            d["uuid"],
            d["name"],
            human_mib(d["memory_mib"]),
            f"{d['used_fraction']:.0%}",  # one unit: a whole GPU held reads 100%, not "1 GPU"
            human_mib(d["free_memory_mib"]),
            holders(d["slices"], d.get("other_users")),
        ]
        for d in doc.get("devices", [])
    ]
    head = f"{doc.get('message', '')} (placement: {doc.get('strategy', '-')})"
    out = head + "\n" + table(["#", "UUID", "NAME", "MEMORY", "USED", "FREE MEMORY", "HELD BY"], rows)
    pools = doc.get("warm_pods") or {}
    if pools:
        each = ", ".join(
            f"{size}: {c['ready']} ready, {c['starting']} starting" for size, c in sorted(pools.items())
        )
        out += f"\n\nWarm pods (each holds a slice, given up to any kernel that needs it): {each}"
    return out


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


#: The NOTEBOOK column's width: the rest of ``list`` fits 80 columns beside it.
NOTEBOOK_WIDTH = 22


def render_kernels(
    kernels: list[dict[str, Any]], notebooks: Mapping[str, str] | None = None, colour: bool = False
) -> str:
    """``list``: one line a kernel, within 80 columns (``--json`` has every field).

    The id as JupyterLab shows it (its first eight characters, which every kernel command
    accepts), the notebook it serves, and one unit a column. An owner column only where the
    kernels have several owners (an admin at a gateway).
    """
    notebooks = notebooks or {}
    owners = len({k.get("owner") for k in kernels} - {None, ""}) > 1
    rows = []
    for k in kernels:
        activity = k.get("activity") or {}
        utilization = activity.get("gpu_utilization")
        memory = activity.get("gpu_memory_mib")
        checkpoint = k.get("checkpoint") or {}
        row = [
            k["id"][:SHORT_ID],
            shorten_path(notebooks.get(k["id"]), NOTEBOOK_WIDTH),
            k.get("profile") or "cpu",
            k.get("state"),
            _duration(activity.get("idle_seconds")),
            "-" if utilization is None else f"{utilization:.0f}%",
            "-" if memory is None else human_mib(memory),
            human_bytes(checkpoint["bytes"]) if checkpoint.get("bytes") else "-",
        ]
        rows.append([*row, k.get("owner")] if owners else row)
    if not rows:
        return "no kernels"
    headers = ["KERNEL", "NOTEBOOK", "SIZE", "STATE", "IDLE", "GPU", "GPU MEM", "CHECKPOINT"]
    paint = {headers.index("STATE"): cli_colour.state} if colour else None
    return table([*headers, "OWNER"] if owners else headers, rows, paint)


def render_kernel(kernel: dict[str, Any]) -> str:
    """One kernel after hibernate/resume: a line that says where it stands."""
    line = f"kernel {kernel['id']} is {kernel.get('state')}"
    checkpoint = kernel.get("checkpoint") or {}
    if kernel.get("state") == "hibernated" and checkpoint:
        not_saved = ", ".join(v["name"] for v in checkpoint.get("not_saved", [])) or "none"
        saved = len(checkpoint.get("saved", []))
        size = human_bytes(checkpoint.get("bytes", 0))
        line += f": {saved} variable(s) saved ({size}), not saved: {not_saved}"
    elif kernel.get("slice"):
        size = f"GPU size {kernel['profile']}, " if kernel.get("profile") else ""
        line += f" ({size}on " + ", ".join(d["uuid"] for d in kernel["slice"]["devices"]) + ")"
    return line


def render_storage(
    doc: dict[str, Any], notebooks: Mapping[str, str] | None = None, now: float | None = None
) -> str:
    """``storage``: each owner's checkpoints against their quota, the longest hibernated first
    (the first to discard with ``jupyter elastic discard``); for admins the volume's free space."""
    notebooks = notebooks or {}
    moment = time.time() if now is None else now
    parts = []
    volume = doc.get("volume")
    if volume:
        parts.append(
            f"checkpoint volume: {human_bytes(volume['free_bytes'])} free of "
            f"{human_bytes(volume['total_bytes'])} ({human_bytes(volume['reserve_bytes'])} kept for "
            "kernels it holds)"
        )
    for owner in doc.get("owners", []):
        quota = owner.get("quota_bytes")
        limit = f"of {human_bytes(quota)} quota" if quota is not None else "(no quota)"
        parts.append(f"{owner['owner']}: {human_bytes(owner['used_bytes'])} {limit}")
        rows = [
            [
                row["kernel_id"][:SHORT_ID],
                shorten_path(notebooks.get(row["kernel_id"]), NOTEBOOK_WIDTH),
                row.get("state"),
                human_bytes(row.get("bytes")),
                _duration(moment - row["hibernated_at"])
                if row.get("hibernated_at") and row.get("state") == "hibernated"
                else "-",
            ]
            for row in owner.get("checkpoints", [])
        ]
        if rows:
            parts.append(table(["KERNEL", "NOTEBOOK", "STATE", "CHECKPOINT", "HIBERNATED FOR"], rows))
    return "\n".join(parts) if parts else "no checkpoints"


def render_report(doc: dict[str, Any]) -> str:
    """``jupyter elastic report``: the last restore, one fact a line."""
    report = doc.get("restore_report")
    kernel = doc.get("id")
    if not report:
        return f"kernel {kernel} has not been resumed from a checkpoint yet"
    if report.get("error"):  # the server did not read it (too large, or a link)
        return f"kernel {kernel}: {report['error']}"
    if report.get("refused"):
        return f"kernel {kernel} resumed without its variables: {report['refused']}"
    lines = [
        f"kernel {kernel} resumed from {report.get('checkpoint')} (saved {report.get('created')})",
        f"restored: {', '.join(report.get('restored', [])) or 'none'}",
    ]
    recomputed = report.get("recomputed") or []
    if recomputed:
        cells = sorted({c for item in recomputed for c in item.get("cells", [])})
        names = ", ".join(item["name"] for item in recomputed)
        lines.append(f"recomputed: {names} (re-ran cells {', '.join(map(str, cells))})")
    for item in report.get("not_restored", []):
        stage = "not saved" if item.get("stage") == "save" else "failed to load"
        line = f"{stage}: {item['name']} ({item.get('reason', '')})"
        if item.get("not_recomputed"):
            line += f"; not recomputed: {item['not_recomputed']}"
        lines.append(line)
    for name, why in (report.get("differs") or {}).items():
        lines.append(f"restored with differences: {name} ({why})")
    return "\n".join(lines)


def queue_place(progress: dict[str, Any]) -> str:
    """ ", number 2 of 3 in the queue, about 4 min" (what the server knows of the wait), or ""."""
    position, waiting, estimate = (
        progress.get("position"),
        progress.get("waiting"),
        progress.get("estimate_s"),
    )
    if not position:
        return ""
    text = f", number {position} of {waiting} in the queue"
    if estimate is not None:
        text += f", about {round(estimate)} s" if estimate < 120 else f", about {round(estimate / 60)} min"
    return text


def render_progress(action: str, model: dict[str, Any] | None) -> str:
    """Where a hibernation or resume stands, from the kernel's model, in a few words."""
    if model is None:
        return f"{action}: no answer from the server yet"
    state = model.get("state")
    if state == "hibernating":
        written = model.get("hibernate") or {}
        if written.get("written_mib") is None:
            return "hibernating: writing the checkpoint"
        about = f" of about {human_mib(written['expected_mib'])}" if written.get("expected_mib") else ""
        return f"hibernating: writing the checkpoint, {human_mib(written['written_mib'])}{about} written"
    if state == "resuming":
        progress = model.get("resume") or {}
        phase = progress.get("phase")
        if phase == "waiting_for_slice":
            place = f"({model.get('profile')}){queue_place(progress)}"
            return f"resuming: waiting for a free GPU slice {place}; Ctrl-C stops waiting"
        if phase == "waiting_for_node":
            return f"resuming: its pod waits for the cluster to add a node ({model.get('profile')})"
        if phase == "restoring":
            done, total = human_mib(progress.get("restored_mib")), human_mib(progress.get("total_mib"))
            return f"resuming: restoring the variables, {done} of {total} read"
        return "resuming: starting the kernel"
    return f"{action}: the kernel is {state}"


class Progress:
    """Where the action stands, on stderr: rewritten in place on a terminal, within its width (a
    longer line wraps, and ``\r`` then rewrites only its last row), else one line a change."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last = ""

    def show(self, kernel_id: str, text: str, elapsed: float) -> None:
        if not self.enabled:
            return
        line = f"jupyter elastic: kernel {kernel_id[:SHORT_ID]} {text}"
        if self.tty:
            shown = f"{line} ({elapsed:.0f}s)"
            width = shutil.get_terminal_size().columns - 1
            if len(shown) > width:
                shown = shown[: max(width - 3, 0)] + "..."
            self.stream.write(f"\r\x1b[K{shown}")
            self.stream.flush()
        elif line != self.last:
            print(line, file=self.stream, flush=True)
        self.last = line

    def done(self) -> None:
        if self.enabled and self.tty and self.last:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
