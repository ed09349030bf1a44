"""A task function for tests of the worker pool itself: it leaves its worker's pid in a file."""

import os
import time
from pathlib import Path


def note_pid(directory: str, name: str, hold_s: float = 0.0) -> int:
    time.sleep(hold_s)
    Path(directory, f"{name}.pid").write_text(str(os.getpid()))
    return os.getpid()
