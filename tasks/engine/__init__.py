"""The in-house conversion engine: documents converted by LibreOffice (headless) and poppler, each
conversion in its own budgeted process (tasks/engine/runner.py), reached through the `local`
dialect of the adapter seam (tasks/vendors/local.py).

What it converts (input family → targets):
- word processing (docx, doc, odt, rtf, txt) → pdf, html, txt, md
- spreadsheets (xlsx, xls, ods) and presentations (pptx, ppt, odp) → pdf (and txt via pdf)
- pdf → txt, md (pdftotext), html (pdftohtml), pdf (checked and passed through)
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

WRITER = ("docx", "doc", "odt", "rtf", "txt")
CALC = ("xlsx", "xls", "ods")
IMPRESS = ("pptx", "ppt", "odp")
TARGETS = ("pdf", "html", "txt", "md")


class ConversionFailed(Exception):
    """A conversion that did not produce its result; `code` classifies why (engine_timeout, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def remove_pipes(profile: Path, pipe: str | None = None) -> None:
    """Remove the named pipes a LibreOffice with this profile made in /tmp (osl puts them there
    whatever TMPDIR says, and a killed LibreOffice leaves them): its single-instance pipe, named by
    the MD5 of the profile's URL in UTF-16 with each byte in unpadded hex, as LibreOffice writes
    it, and `pipe`, the one it was told to accept on."""
    digest = hashlib.md5(f"file://{profile}".encode("utf-16-le")).digest()
    for name in ("SingleOfficeIPC_" + "".join(format(byte, "x") for byte in digest), pipe):
        if name and "/" not in name:
            Path(f"/tmp/OSL_PIPE_{os.getuid()}_{name}").unlink(missing_ok=True)


def daemonize() -> None:
    """Detach this process: the one that started it returns at once, and it is nobody's zombie
    (double fork, its own session, standard streams on /dev/null)."""
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


def soffice() -> str | None:
    return shutil.which("soffice") or shutil.which("libreoffice")


def installed() -> bool:
    """LibreOffice and poppler's pdftotext are both on the PATH."""
    return bool(soffice() and shutil.which("pdftotext"))


@functools.lru_cache(maxsize=1)
def engine_version() -> str:
    """What converts, e.g. "LibreOffice 7.4.7.2 + poppler 22.12.0": recorded on every job and part
    of the quarantine key of a document that keeps breaking it."""
    if not installed():
        return "not-installed"
    try:
        office = subprocess.run([soffice(), "--version"], capture_output=True, text=True, timeout=60).stdout.split()
        poppler = subprocess.run(["pdftotext", "-v"], capture_output=True, text=True, timeout=10)
        poppler_words = (poppler.stderr or poppler.stdout).split()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    office_version = office[1] if len(office) > 1 else "?"
    poppler_version = poppler_words[2] if len(poppler_words) > 2 else "?"
    return f"LibreOffice {office_version} + poppler {poppler_version}"[:64]


def plan(extension: str, target: str) -> list[str] | None:
    """The steps that turn a file of this extension into `target`, or None if the engine can't:
    "office-pdf", "office-html", "office-txt", "pdf-txt", "pdf-html", "copy"."""
    ext = extension.lower().lstrip(".")
    if target not in TARGETS:
        return None
    if ext == "pdf":
        return {"pdf": ["copy"], "txt": ["pdf-txt"], "md": ["pdf-txt"], "html": ["pdf-html"]}[target]
    if ext in WRITER:
        return {"pdf": ["office-pdf"], "html": ["office-html"], "txt": ["office-txt"], "md": ["office-txt"]}[target]
    if ext in CALC + IMPRESS:
        return {"pdf": ["office-pdf"], "txt": ["office-pdf", "pdf-txt"], "md": ["office-pdf", "pdf-txt"],
                "html": ["office-html"]}[target]
    return None
