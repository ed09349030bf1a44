"""The registered fault types, in the order forms and documentation list them.

Adding a fault type: write `kinds/<name>.py` defining `FAULT` (a `base.Fault`), and add its name
here. tests/unit/test_fault_registry.py checks that every module is registered, that each
declares what it must, and that the documentation's table is the one generated from here.
"""

from __future__ import annotations

from importlib import import_module

from fakevendor.faults.base import FAMILIES, STAGES, Fault

REGISTERED = (
    # wire: what happens on the socket
    "delay", "stall", "dribble", "bandwidth", "http_error", "rate_limit", "reset", "close", "garbage", "goaway",
    "response_lost", "redirect", "malformed", "malformed_chunk", "slicer", "timeout", "reset_peer", "limit_data", "slow_close",
    # create: how a job create behaves
    "ignore_idempotency", "duplicate_create", "duplicate_on_create",
    # job: what the created job does later
    "job_fail", "stuck", "digest_mismatch", "input_digest_mismatch", "transient_404",
)


def _load() -> dict[str, Fault]:
    faults: dict[str, Fault] = {}
    for name in REGISTERED:
        fault = import_module(f"fakevendor.faults.kinds.{name}").FAULT
        if fault.name != name:
            raise ImportError(f"fakevendor/faults/kinds/{name}.py defines {fault.name!r}")
        if fault.family not in FAMILIES or not fault.stages or set(fault.stages) - set(STAGES):
            raise ImportError(f"fault {name}: family in {FAMILIES} and stages in {STAGES}")
        faults[name] = fault
    return faults


FAULTS: dict[str, Fault] = _load()
