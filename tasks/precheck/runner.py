"""Entry point of the pre-check subprocess: `python runner.py PATH EXTENSION [PLUGIN ...]`.

Prints one JSON document on stdout: {"ok": true, "findings": {...}} or {"ok": false,
"error_class": "..."}. Exceptions are reduced to their class name: no file content ever leaves.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    path, extension, plugins = Path(argv[1]), argv[2], argv[3:]
    try:
        from tasks.precheck.detectors import inspect

        findings = inspect(path, extension)
        for dotted in plugins:
            module_name, _, attribute = dotted.rpartition(".")
            getattr(importlib.import_module(module_name), attribute)(path, findings)
    except BaseException as exc:  # noqa: BLE001 - a crash is reported as its class only
        sys.stdout.write(json.dumps({"ok": False, "error_class": type(exc).__name__}))
        sys.stdout.flush()
        return 3
    sys.stdout.write(json.dumps({"ok": True, "findings": findings}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    raise SystemExit(main(sys.argv))
