"""The checkpoint manifest: what a checkpoint holds, described in plain JSON.

A checkpoint is two files: ``data.bin`` (pickle streams and raw buffers, back to back) and
``manifest.json``, described here. The manifest is the only part anyone reads without
unpickling: the server shows it in the REST API (``summary()``), the agent uses it to find
each group's bytes in ``data.bin``, and the integrity check covers it with an HMAC. Keeping
it in the core (stdlib only) lets the server, the CLI and the tests read checkpoints without
importing IPython or any pickling library.

Parsing is strict on purpose: a manifest is read *before* the integrity check has been
completed for the data file, so every field is type-checked and a malformed one raises
:class:`ManifestError` with the field's name instead of a ``KeyError`` deep inside a reader.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from kernelmgr.core.errors import ElasticError

#: Version tag of the on-disk format. Readers refuse anything else rather than guess.
FORMAT = "elastic-checkpoint/1"

Status = Literal["saved", "skipped"]
STATUSES: tuple[str, ...] = ("saved", "skipped")


class ManifestError(ElasticError):
    """A manifest that is not valid JSON or does not have the expected shape."""


def _check_int(where: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"manifest: {where} must be an integer, got {value!r}")
    if value < minimum:
        raise ManifestError(f"manifest: {where} must be >= {minimum}, got {value}")
    return value


def _check_str(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"manifest: {where} must be a string, got {value!r}")
    return value


def _check_number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ManifestError(f"manifest: {where} must be a number, got {value!r}")
    return float(value)


def _check_mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ManifestError(f"manifest: {where} must be an object, got {type(value).__name__}")
    return value


def _check_list(where: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"manifest: {where} must be a list, got {type(value).__name__}")
    return value


def _require(where: str, raw: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [key for key in keys if key not in raw]
    if missing:
        raise ManifestError(f"manifest: {where} is missing {', '.join(missing)}")


@dataclass(frozen=True)
class VariableRecord:
    """One user variable: saved in a group, or skipped with the reason.

    ``bytes`` is the size on disk of the group the variable was saved in. For a variable
    that shares objects with others, that is the whole group's size (the bytes cannot be
    split between names); ``Manifest.totals["bytes"]`` is the exact total.

    ``fingerprint`` (saved variables; optional, absent from older manifests) is a small
    structural description of the value as it was saved, ``{path: description}``, that the
    reader compares with the restored value to report differences
    (``kernelmgr.checkpoint.fidelity``).
    """

    name: str
    type: str
    status: Status
    reason: str = ""
    group: int | None = None
    bytes: int = 0
    fingerprint: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "type": self.type,
            "status": self.status,
            "reason": self.reason,
            "group": self.group,
            "bytes": self.bytes,
        }
        if self.fingerprint is not None:
            out["fingerprint"] = dict(self.fingerprint)
        return out

    @classmethod
    def from_dict(cls, raw: Any, where: str = "variable") -> VariableRecord:
        raw = _check_mapping(where, raw)
        _require(where, raw, ("name", "type", "status", "reason", "group", "bytes"))
        status = _check_str(f"{where}.status", raw["status"])
        if status not in STATUSES:
            raise ManifestError(f"manifest: {where}.status must be one of {STATUSES}, got {status!r}")
        group = raw["group"]
        if group is not None:
            group = _check_int(f"{where}.group", group)
        if status == "saved" and group is None:
            raise ManifestError(f"manifest: {where} is saved but names no group")
        fingerprint = None
        if raw.get("fingerprint") is not None:
            fingerprint = {
                _check_str(f"{where}.fingerprint key", k): _check_str(f"{where}.fingerprint[{k!r}]", v)
                for k, v in _check_mapping(f"{where}.fingerprint", raw["fingerprint"]).items()
            }
        return cls(
            name=_check_str(f"{where}.name", raw["name"]),
            type=_check_str(f"{where}.type", raw["type"]),
            status="saved" if status == "saved" else "skipped",
            reason=_check_str(f"{where}.reason", raw["reason"]),
            group=group,
            bytes=_check_int(f"{where}.bytes", raw["bytes"]),
            fingerprint=fingerprint,
        )


@dataclass(frozen=True)
class GroupRecord:
    """Variables pickled together, and where their bytes are in ``data.bin``.

    One pickle stream at ``pickle_offset`` (``pickle_length`` bytes), then its out-of-band
    buffers as ``(offset, length)`` pairs in the order the pickler produced them, which is
    the order ``pickle.loads(..., buffers=...)`` consumes them.
    """

    id: int
    names: list[str]
    pickle_offset: int
    pickle_length: int
    buffers: list[tuple[int, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of this group on disk (pickle stream plus buffers, without padding)."""
        return self.pickle_length + sum(length for _, length in self.buffers)

    def regions(self) -> list[tuple[int, int]]:
        """Every ``(offset, length)`` this group occupies in ``data.bin``."""
        return [(self.pickle_offset, self.pickle_length), *self.buffers]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "names": list(self.names),
            "pickle_offset": self.pickle_offset,
            "pickle_length": self.pickle_length,
            "buffers": [[offset, length] for offset, length in self.buffers],
        }

    @classmethod
    def from_dict(cls, raw: Any, where: str = "group") -> GroupRecord:
        raw = _check_mapping(where, raw)
        _require(where, raw, ("id", "names", "pickle_offset", "pickle_length", "buffers"))
        names = [
            _check_str(f"{where}.names[{i}]", name)
            for i, name in enumerate(_check_list(f"{where}.names", raw["names"]))
        ]
        buffers: list[tuple[int, int]] = []
        for i, pair in enumerate(_check_list(f"{where}.buffers", raw["buffers"])):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ManifestError(f"manifest: {where}.buffers[{i}] must be [offset, length]")
            buffers.append(
                (
                    _check_int(f"{where}.buffers[{i}] offset", pair[0]),
                    _check_int(f"{where}.buffers[{i}] length", pair[1]),
                )
            )
        return cls(
            id=_check_int(f"{where}.id", raw["id"]),
            names=names,
            pickle_offset=_check_int(f"{where}.pickle_offset", raw["pickle_offset"]),
            pickle_length=_check_int(f"{where}.pickle_length", raw["pickle_length"]),
            buffers=buffers,
        )


def iso_utc(epoch: float) -> str:
    """``epoch`` as ISO 8601 in UTC, e.g. ``2025-01-31T12:00:00.123456Z``."""
    return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat().replace("+00:00", "Z")


#: The data digest of checkpoints written before the algorithm was recorded.
LEGACY_DIGEST = "sha256"
#: Algorithms a manifest may name for its data digest.
DIGEST_ALGORITHMS = ("sha256", "blake3")


def _digest_from(raw: Mapping[str, Any]) -> dict[str, str]:
    """``data_digest`` and ``digest_algorithm`` from either JSON shape (see :class:`Manifest`)."""
    if "data_sha256" in raw:
        if "data_digest" in raw or "digest_algorithm" in raw:
            raise ManifestError("manifest: both data_sha256 and data_digest are set; not written by us")
        legacy = _check_str("data_sha256", raw["data_sha256"])
        return {"data_digest": legacy, "digest_algorithm": LEGACY_DIGEST}
    _require("the manifest", raw, ("data_digest", "digest_algorithm"))
    algorithm = _check_str("digest_algorithm", raw["digest_algorithm"])
    if algorithm not in DIGEST_ALGORITHMS or algorithm == LEGACY_DIGEST:
        raise ManifestError(
            f"manifest: unknown data digest algorithm {algorithm!r} (this reader knows "
            f"{', '.join(a for a in DIGEST_ALGORITHMS if a != LEGACY_DIGEST)}, or data_sha256)"
        )
    return {"data_digest": _check_str("data_digest", raw["data_digest"]), "digest_algorithm": algorithm}


_FIELDS = (
    "format",
    "checkpoint_id",
    "kernel_id",
    "owner",
    "created",
    "python",
    "libraries",
    "variables",
    "groups",
    "totals",
    "timings",
    "hmac",
)


@dataclass
class Manifest:
    """Everything known about one checkpoint.

    ``data_digest`` is the digest of ``data.bin`` (the hash of each 16 MiB chunk's hash, with
    ``digest_algorithm``: ``blake3``, or ``sha256`` for checkpoints written before BLAKE3 or
    where it is not installed; see ``kernelmgr.checkpoint.integrity.DataDigest``). A SHA-256
    manifest keeps its original JSON shape (one ``data_sha256`` field) so the HMAC of
    checkpoints written before the choice existed still verifies. The ``hmac`` covers every field,
    so it covers the data too while letting the server verify a manifest without reading
    gigabytes of data (the agent checks the data digest itself, before unpickling).
    ``totals`` holds counts and ``bytes`` (the size of ``data.bin``); ``timings`` holds
    seconds per phase (``serialize``, ``write``, ``fsync``, ``total``).
    """

    checkpoint_id: str
    kernel_id: str
    owner: str
    created: float
    python: str
    libraries: dict[str, str] = field(default_factory=dict)
    variables: list[VariableRecord] = field(default_factory=list)
    groups: list[GroupRecord] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    data_digest: str = ""
    digest_algorithm: str = LEGACY_DIGEST
    hmac: str = ""
    format: str = FORMAT
    #: The cell record (``kernelmgr.checkpoint.cells``): one JSON object per executed cell,
    #: kept here so the HMAC covers it (its sources are re-run on resume) and it is committed
    #: with the checkpoint. Omitted from the JSON when empty.
    cells: list[dict[str, Any]] = field(default_factory=list)

    @property
    def data_bytes(self) -> int:
        return int(self.totals.get("bytes", 0))

    def saved(self) -> list[VariableRecord]:
        return [v for v in self.variables if v.status == "saved"]

    def skipped(self) -> list[VariableRecord]:
        return [v for v in self.variables if v.status == "skipped"]

    def to_dict(self, *, with_hmac: bool = True) -> dict[str, Any]:
        """The JSON shape. ``with_hmac=False`` is what the HMAC is computed over."""
        out: dict[str, Any] = {
            "format": self.format,
            "checkpoint_id": self.checkpoint_id,
            "kernel_id": self.kernel_id,
            "owner": self.owner,
            "created": self.created,
            "python": self.python,
            "libraries": dict(self.libraries),
            **self._digest_fields(),
            "variables": [v.to_dict() for v in self.variables],
            "groups": [g.to_dict() for g in self.groups],
            "totals": dict(self.totals),
            "timings": dict(self.timings),
        }
        if self.cells:
            out["cells"] = [dict(cell) for cell in self.cells]
        if with_hmac:
            out["hmac"] = self.hmac
        return out

    def _digest_fields(self) -> dict[str, str]:
        if self.digest_algorithm == LEGACY_DIGEST:
            return {"data_sha256": self.data_digest}
        return {"data_digest": self.data_digest, "digest_algorithm": self.digest_algorithm}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, raw: Any) -> Manifest:
        raw = _check_mapping("the manifest", raw)
        _require("the manifest", raw, _FIELDS)
        fmt = _check_str("format", raw["format"])
        if fmt != FORMAT:
            raise ManifestError(
                f"manifest: unsupported checkpoint format {fmt!r} (this reader knows {FORMAT!r})"
            )
        libraries = {
            _check_str("libraries key", k): _check_str(f"libraries[{k!r}]", v)
            for k, v in _check_mapping("libraries", raw["libraries"]).items()
        }
        totals = {
            _check_str("totals key", k): _check_int(f"totals[{k!r}]", v)
            for k, v in _check_mapping("totals", raw["totals"]).items()
        }
        timings = {
            _check_str("timings key", k): _check_number(f"timings[{k!r}]", v)
            for k, v in _check_mapping("timings", raw["timings"]).items()
        }
        variables = [
            VariableRecord.from_dict(v, f"variables[{i}]")
            for i, v in enumerate(_check_list("variables", raw["variables"]))
        ]
        groups = [
            GroupRecord.from_dict(g, f"groups[{i}]")
            for i, g in enumerate(_check_list("groups", raw["groups"]))
        ]
        cells = [
            dict(_check_mapping(f"cells[{i}]", c))
            for i, c in enumerate(_check_list("cells", raw.get("cells", [])))
        ]
        manifest = cls(
            format=fmt,
            cells=cells,
            checkpoint_id=_check_str("checkpoint_id", raw["checkpoint_id"]),
            kernel_id=_check_str("kernel_id", raw["kernel_id"]),
            owner=_check_str("owner", raw["owner"]),
            created=_check_number("created", raw["created"]),
            python=_check_str("python", raw["python"]),
            libraries=libraries,
            **_digest_from(raw),
            variables=variables,
            groups=groups,
            totals=totals,
            timings=timings,
            hmac=_check_str("hmac", raw["hmac"]),
        )
        manifest._check_consistent()
        return manifest

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest: not valid JSON ({exc})") from None
        return cls.from_dict(raw)

    def _check_consistent(self) -> None:
        """Cross-field rules: unique ids and names, every saved variable in its group."""
        group_ids = [g.id for g in self.groups]
        if len(set(group_ids)) != len(group_ids):
            raise ManifestError("manifest: duplicate group ids")
        names = [v.name for v in self.variables]
        if len(set(names)) != len(names):
            raise ManifestError("manifest: duplicate variable names")
        members = {name: g.id for g in self.groups for name in g.names}
        for v in self.variables:
            if v.status == "saved" and members.get(v.name) != v.group:
                raise ManifestError(f"manifest: variable {v.name!r} is not listed in group {v.group}")

    def summary(self) -> dict[str, Any]:
        """The shape the REST API shows for a kernel's checkpoint."""
        return {
            "id": self.checkpoint_id,
            "created": iso_utc(self.created),
            "bytes": self.data_bytes,
            "saved": [v.name for v in self.saved()],
            "not_saved": [{"name": v.name, "type": v.type, "reason": v.reason} for v in self.skipped()],
            "seconds": round(float(self.timings.get("total", 0.0)), 3),
        }
