"""Named file contents a scenario's workload can ask for. Each carries the run's distinctive
marker where the format allows it, so the secrets check can look for file content in logs."""

from __future__ import annotations

from collections.abc import Callable

from tasks.poc import documents, files
from tasks.precheck import hostile

GENERATORS: dict[str, Callable[[bytes], bytes]] = {
    "wav": lambda m: files.with_marker(files.wav(2), m),
    "wav_long": lambda m: files.with_marker(files.wav(60), m),  # ~0.96 MB
    "wav_big": lambda m: files.with_marker(files.wav(240), m),  # ~3.8 MB
    "pdf": lambda m: files.with_marker(files.pdf(3), m),
    "pdf_heavy": lambda m: files.with_marker(files.pdf(320), m),  # heavy lane by page count
    "docx": lambda m: files.docx(),
    "office_doc": lambda m: documents.docx(f"Sluice memo {m.hex()}", pages=2),  # a real document for the engine
    # Heavy by page count (the lane) and by work: about 1.5 s of LibreOffice each, against 0.1 s.
    "office_heavy": lambda m: documents.docx(f"Sluice manual {m.hex()}", pages=320, lines=12),
    "text": lambda m: files.with_marker(files.text(4000), m),
    "text_big": lambda m: files.with_marker(files.text(200_000), m),
    "truncated_pdf": lambda m: files.truncated_pdf(),
    "zip_bomb_docx": lambda m: files.zip_bomb_docx(300),
    "exe_as_wav": lambda m: files.elf_executable(),
    "precheck_crash": lambda m: files.with_marker(files.text(2000), hostile.CRASH_MARKER + m),
}


def make(name: str, *, index: int, marker: bytes) -> bytes:
    try:
        return GENERATORS[name](marker)
    except KeyError:
        raise ValueError(f"unknown content {name!r}; known: {', '.join(GENERATORS)}") from None
