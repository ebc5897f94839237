"""Settings that change while the server runs: GPU sizes, the cull policy and the gateway's quotas.

``ElasticKernels.live_config_file`` names a JSON file of traitlets config (as
``jupyter_server_config.json``) holding only the live settings, :data:`LIVE_SECTIONS` (of
``ElasticKernels``: only ``profiles``). It is read at start, merged over the server's configuration,
and then re-read every ``ElasticKernels.live_config_interval`` seconds: a changed file is validated
whole (off the event loop: a new size's pod is dry-run by the API server) and applied at once,
without a restart, so an admin adds a GPU size or a user to a quota and no kernel notices but by the
new rule. In the chart it is a ConfigMap of its own, mounted as a folder (the kubelet replaces the
file when the ConfigMap changes), and its changes do not restart the gateway.

A file that is invalid at start stops the server (exit code 2, one line); one that becomes invalid
later is refused with one error line in the log and the previous settings stay. What a change means:

- ``ElasticKernels.profiles``: a new size is offered as a kernelspec at once; a removed one is no
  longer offered for new kernels, while its running and hibernated kernels keep it (they run,
  hibernate and resume with it: ``ElasticRuntime.retired``); a changed one applies to the next start
  or resume, a running kernel keeps the slice it was given. The same checks as at start apply (in
  Kubernetes mode the new or changed sizes' pods are dry-run), and the cull policy and the quotas
  are validated against the new sizes: a rule or a quota naming a removed size refuses the change.
- ``CullPolicy``: the next tick decides by the new rules (timeouts, warnings, per-size rules, TTL,
  interval); kernels already warned or queued for hibernation are decided again when their turn
  comes. ``max_concurrent_hibernations`` applies to the next server start.
- ``ElasticQuota``: the next start or resume is checked against it; running kernels over a lowered
  quota keep running (nothing is taken away), and the GPU sizes a user sees follow at once.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Callable

from tornado import ioloop
from traitlets import TraitError
from traitlets.config import Config

from kernelmgr.config import ElasticKernels
from kernelmgr.core.errors import ConfigError

#: The configuration sections that may change while the server runs.
LIVE_SECTIONS = ("CullPolicy", "ElasticQuota", "ElasticKernels")
#: Of these sections, the only settings that may (the others are whole sections).
LIVE_SETTINGS = {"ElasticKernels": ("profiles",)}

#: Given the whole configuration with the new live sections, validate them (raise ConfigError) and
#: return what applies them.
Applier = Callable[[Config], Callable[[], None]]


def parse(text: str, path: str) -> Config:
    """The live sections of ``text``; anything else is a ConfigError naming it."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"ElasticKernels.live_config_file {path}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"ElasticKernels.live_config_file {path}: must be a JSON object of sections")
    other = sorted(set(raw) - set(LIVE_SECTIONS))
    if other:
        raise ConfigError(
            f"ElasticKernels.live_config_file {path}: only {', '.join(LIVE_SECTIONS)} may change while "
            f"the server runs; {', '.join(other)} belong in the server's configuration"
        )
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"ElasticKernels.live_config_file {path}: {section} must be an object")
        allowed = LIVE_SETTINGS.get(section)
        extra = sorted(set(values) - set(allowed)) if allowed is not None else []
        if extra:
            raise ConfigError(
                f"ElasticKernels.live_config_file {path}: of {section}, only "
                f"{', '.join(f'{section}.{name}' for name in allowed or ())} may change while the "
                f"server runs; {', '.join(f'{section}.{name}' for name in extra)} belong in the server's "
                "configuration"
            )
    return Config(raw)


def sizes(config: Config) -> list[str]:
    """The GPU size names of ``config`` (validated): what a live change's policy and quotas may name."""
    return list(ElasticKernels(config=config).build_profiles())


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError(f"ElasticKernels.live_config_file {path}: {exc.strerror}") from None


class LiveConfig:
    """The live file: read at start, then watched; each change validated and applied whole."""

    def __init__(self, path: str, base: Config, log: logging.Logger, interval: float) -> None:
        self.path = path
        #: The server's configuration without the live file (each change is merged over a copy).
        self.base = copy.deepcopy(base)
        self.log = log
        self.interval = interval
        self.appliers: list[Applier] = []
        #: How many changes were applied since the start (the first read is not one).
        self.reloads = 0
        self._text = ""
        self._timer: ioloop.PeriodicCallback | None = None

    def initial(self) -> Config:
        """The live sections at start (merged into the server's config by the caller)."""
        self._text = read(self.path)
        return parse(self._text, self.path)

    def start(self) -> LiveConfig:
        self._timer = ioloop.PeriodicCallback(self.check, self.interval * 1000)
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.stop()

    async def check(self) -> bool:
        """Apply the file if it changed; ``True`` when it was applied."""
        try:
            text = await asyncio.to_thread(read, self.path)
        except ConfigError as exc:
            self.log.error("Live configuration not reloaded: %s", exc.message)
            return False
        if text == self._text:
            return False
        self._text = text
        try:
            config = copy.deepcopy(self.base)
            config.merge(parse(text, self.path))
            # Off the loop: preparing may ask the API server (a new size's pod, dry-run).
            applies = await asyncio.to_thread(lambda: [prepare(config) for prepare in self.appliers])
        except (ConfigError, TraitError) as exc:
            message = exc.message if isinstance(exc, ConfigError) else " ".join(str(exc).split())
            self.log.error("Live configuration refused, the previous one stays: %s", message)
            return False
        for apply in applies:
            apply()
        self.reloads += 1
        self.log.info(
            "Live configuration reloaded from %s (%s)", self.path, ", ".join(sorted(json.loads(text)))
        )
        return True
