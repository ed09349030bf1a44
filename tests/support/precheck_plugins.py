"""Pre-check plugins for the tests: they run where every plugin runs, in the sandbox's child."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def where(path: Path, findings: dict[str, Any]) -> None:
    """Say which process forked the child, and print what a chatty parser would."""
    findings["forked_by"] = os.getppid()
    print("a parser's chatter on stdout\n{not json", flush=True)
    print("and on stderr", file=sys.stderr, flush=True)
