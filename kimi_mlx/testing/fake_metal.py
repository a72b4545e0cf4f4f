"""A fake Metal device for tests: `install()` makes `placement.wired` see a Mac.

Test support only (the product never imports it). A test runs a product process (a
command, a stage, a tensor rank) with `env(...)`: PYTHONPATH names the folder of a
`sitecustomize.py` (tests/data/fake_metal_site) that calls `install_from_env()` at
interpreter start when KIMI_MLX_FAKE_METAL holds a JSON object:

    {"device_info": {...mx.device_info() of a Mac...}, "record": "/path/to/calls.jsonl",
     "wired_limit": 0}

From then on `placement.wired` sees `mx.metal.is_available()` True, `mx.device_info()` /
`mx.metal.device_info()` return `device_info`, and `mx.set_wired_limit` /
`mx.metal.set_wired_limit` append one JSON line {"pid", "argv", "limit", "old"} to
`record` and return the previous limit (starting at `wired_limit`), refusing a limit
above `max_recommended_working_set_size` as MLX's Metal allocator does. Only the module
that sets the limit is patched (through its `mx` name): the kernels keep the real MLX, so
nothing else in the process believes it is on a Mac.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Optional

ENV = "KIMI_MLX_FAKE_METAL"
SITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "tests", "data", "fake_metal_site")


class _Device:
    def __init__(self, real, info: Dict[str, Any], record: Optional[str], limit: int = 0):
        self._real, self.info, self.record, self.limit = real, dict(info), record, int(limit)

    def device_info(self) -> Dict[str, Any]:
        return dict(self.info)

    def set_wired_limit(self, limit: int) -> int:
        limit = int(limit)
        cap = int(self.info.get("max_recommended_working_set_size", 0))
        if limit > cap:  # MLX: metal::set_wired_limit refuses a limit past the working set
            raise ValueError("[metal::set_wired_limit] Setting a wired limit larger than "
                             "the maximum working set size is not allowed.")
        old, self.limit = self.limit, limit
        if self.record:
            line = json.dumps({"pid": os.getpid(), "argv": sys.argv, "limit": limit, "old": old})
            fd = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        return old


class _FakeMetalNS:
    def __init__(self, real_metal, dev: _Device):
        self._real, self._dev = real_metal, dev

    def is_available(self) -> bool:
        return True

    def device_info(self):
        return self._dev.device_info()

    def set_wired_limit(self, limit):
        return self._dev.set_wired_limit(limit)

    def __getattr__(self, name):
        return getattr(self._real, name)


class FakeMx:
    """`mlx.core` as seen from a Mac: everything real but the Metal queries above."""

    def __init__(self, real, info: Dict[str, Any], record: Optional[str] = None, limit: int = 0):
        self._real = real
        self.device = _Device(real, info, record, limit)
        self.metal = _FakeMetalNS(real.metal, self.device)

    def device_info(self):
        return self.device.device_info()

    def set_wired_limit(self, limit):
        return self.device.set_wired_limit(limit)

    def __getattr__(self, name):
        return getattr(self._real, name)


def install(info: Dict[str, Any], record: Optional[str] = None, limit: int = 0) -> FakeMx:
    """Make `kimi_mlx.placement.wired` see a Metal device with `info`; returns the fake."""
    import mlx.core as mx

    from kimi_mlx.placement import wired

    fake = FakeMx(mx, info, record, limit)
    wired.mx = fake
    return fake


def install_from_env() -> Optional[FakeMx]:
    """`install` from KIMI_MLX_FAKE_METAL (JSON), or nothing when it is unset."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    spec = json.loads(raw)
    return install(spec["device_info"], spec.get("record"), int(spec.get("wired_limit", 0)))


def env(info: Dict[str, Any], record: str, base: Optional[Dict[str, str]] = None,
        limit: int = 0) -> Dict[str, str]:
    """An environment for a child process that starts with the fake installed."""
    e = dict(os.environ if base is None else base)
    e[ENV] = json.dumps({"device_info": info, "record": str(record), "wired_limit": limit})
    e["PYTHONPATH"] = os.pathsep.join([SITE_DIR] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    return e


def records(path) -> list:
    """The JSON lines a fake device recorded (empty when none yet)."""
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except FileNotFoundError:
        return []
