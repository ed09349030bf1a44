"""Detector plugins that misbehave on purpose, to prove the sandbox's limits.

Enabled only through SLUICE_PRECHECK_PLUGINS (QA scenarios and tests do). Each acts only on files
that carry its marker, standing in for a parser bug triggered by a hostile file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CRASH_MARKER = b"SLUICE-PRECHECK-CRASH"
LOOP_MARKER = b"SLUICE-PRECHECK-LOOP"
ALLOCATE_MARKER = b"SLUICE-PRECHECK-ALLOCATE"


def _has(path: Path, marker: bytes) -> bool:
    with open(path, "rb") as handle:
        return marker in handle.read(64 * 1024)


def crash(path: Path, findings: dict[str, Any]) -> None:
    if _has(path, CRASH_MARKER):
        os.abort()


def loop(path: Path, findings: dict[str, Any]) -> None:
    if _has(path, LOOP_MARKER):
        while True:
            pass


def allocate(path: Path, findings: dict[str, Any]) -> None:
    if _has(path, ALLOCATE_MARKER):
        hog = []
        while True:
            hog.append(bytearray(64 * 1024 * 1024))
