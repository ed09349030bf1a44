"""Detectors: what a file really is and what it would cost, read with bounded effort.

This module runs inside the sandboxed subprocess (see sandbox.py) and imports no Django. Every
read is bounded; nothing is unpacked to disk. A finding of `verdict: quarantine` names a reason
from tasks.models.Quarantine.Reason.
"""

from __future__ import annotations

# Imported (and warmed: mutagen loads its format modules on first use) in the parent, so a forked
# pre-check does not pay for the imports each time.
import io
import math
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

import mutagen

try:
    mutagen.File(io.BytesIO(bytes(256)))
except Exception:
    pass

from tasks.filetypes import (
    ARCHIVE,
    AUDIO,
    DOCUMENT,
    EXECUTABLE,
    EXTENSION_FAMILY,
    MEDIA,
    OOXML,
    TEXT,
    UNKNOWN,
    sniff,
)
from tasks.precheck import DETECTOR_VERSION

ZIP_MAX_ENTRIES = 10_000
ZIP_MAX_TOTAL_BYTES = 512 * 1024 * 1024
ZIP_MAX_RATIO = 100
ZIP_READ_CAP_BYTES = 256 * 1024 * 1024
PDF_SCAN_BYTES = 64 * 1024 * 1024
MAX_AUDIO_MINUTES = 8 * 60
MAX_PAGES = 10_000
PAGE_MARKER = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")
OLE_ENCRYPTION_STREAM = "EncryptionInfo".encode("utf-16-le")


def inspect(path: Path, extension: str) -> dict[str, Any]:
    """All findings for one file."""
    with open(path, "rb") as handle:
        head = handle.read(8192)
    size = path.stat().st_size
    sniffed = sniff(head)
    findings: dict[str, Any] = {
        "detector_version": DETECTOR_VERSION,
        "size": size,
        "content_type": sniffed.mime,
        "family": sniffed.family,
        "extension": extension,
        "extension_family": EXTENSION_FAMILY.get(extension),
        "pages": None,
        "audio_minutes": None,
        "encrypted": False,
        "risk": "low",
        "verdict": "pass",
        "reason": None,
        "notes": [],
    }
    if sniffed.family == EXECUTABLE:
        return quarantine(findings, "executable", "the content is an executable program")
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        inspect_zip(path, findings)
    elif head.startswith(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"):
        inspect_ole(path, findings)
    elif sniffed.mime == "application/pdf":
        inspect_pdf(path, findings)
    elif sniffed.family == AUDIO or extension in ("wav", "mp3", "flac", "ogg", "oga", "opus", "m4a"):
        inspect_audio(path, findings)
    if findings["verdict"] != "pass":
        return findings
    family = findings["family"]
    wanted = findings["extension_family"]
    if wanted and family not in (UNKNOWN,) and family != wanted and not (wanted == TEXT and family == DOCUMENT):
        return quarantine(findings, "type_mismatch", f"the name says {wanted} but the content is {family}")
    if family == ARCHIVE:
        return quarantine(findings, "unsupported_type", "a plain archive is not a document")
    if family == MEDIA:
        return quarantine(findings, "unsupported_type", "images and video are not processed")
    if family == UNKNOWN:
        findings["risk"] = "unknown"
        findings["notes"].append("content type not recognised")
    if findings["pages"] is not None and findings["pages"] > MAX_PAGES:
        return quarantine(findings, "over_limit", f"more than {MAX_PAGES} pages")
    if findings["audio_minutes"] is not None and findings["audio_minutes"] > MAX_AUDIO_MINUTES:
        return quarantine(findings, "over_limit", f"longer than {MAX_AUDIO_MINUTES} minutes")
    if family == TEXT and findings["pages"] is None:
        findings["pages"] = max(1, math.ceil(findings["size"] / 3000))
    return findings


def quarantine(findings: dict[str, Any], reason: str, note: str) -> dict[str, Any]:
    findings["verdict"] = "quarantine"
    findings["reason"] = reason
    findings["notes"].append(note)
    return findings


def inspect_zip(path: Path, findings: dict[str, Any]) -> None:
    """Office/ODF containers: real type, encryption, and unpacked cost read without unpacking to disk."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError):
        quarantine(findings, "corrupt_file", "the zip container is damaged")
        return
    with archive:
        infos = archive.infolist()
        if len(infos) > ZIP_MAX_ENTRIES:
            quarantine(findings, "zip_bomb", f"more than {ZIP_MAX_ENTRIES} entries")
            return
        names = {info.filename for info in infos}
        declared = sum(info.file_size for info in infos)
        compressed = sum(info.compress_size for info in infos) or 1
        findings["zip"] = {"entries": len(infos), "declared_bytes": declared, "compressed_bytes": compressed}
        if "word/document.xml" in names:
            findings["content_type"], findings["family"] = OOXML["docx"], DOCUMENT
        elif "xl/workbook.xml" in names:
            findings["content_type"], findings["family"] = OOXML["xlsx"], DOCUMENT
        elif "ppt/presentation.xml" in names:
            findings["content_type"], findings["family"] = OOXML["pptx"], DOCUMENT
        elif "mimetype" in names:
            findings["family"] = DOCUMENT
        else:
            findings["family"] = ARCHIVE
        if any(info.flag_bits & 0x1 for info in infos):
            findings["encrypted"] = True
            quarantine(findings, "encrypted_document", "entries are password-protected")
            return
        if declared > ZIP_MAX_TOTAL_BYTES or declared / compressed > ZIP_MAX_RATIO:
            quarantine(findings, "zip_bomb", f"unpacks to {declared} bytes ({declared // compressed}x)")
            return
        # Headers can lie: decompress (to nowhere) with a hard cap and compare.
        actual = 0
        for info in infos:
            try:
                with archive.open(info) as member:
                    while True:
                        chunk = member.read(1024 * 1024)
                        if not chunk:
                            break
                        actual += len(chunk)
                        if actual > min(ZIP_READ_CAP_BYTES, ZIP_MAX_TOTAL_BYTES) or actual > compressed * ZIP_MAX_RATIO:
                            findings["zip"]["actual_bytes_at_stop"] = actual
                            quarantine(findings, "zip_bomb", "unpacks far beyond its size (headers understate it)")
                            return
            except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError):
                quarantine(findings, "corrupt_file", "an entry of the zip container is damaged")
                return
        findings["zip"]["actual_bytes"] = actual
        if findings["family"] == DOCUMENT:
            pages = _ooxml_pages(archive, names)
            findings["pages"] = pages or max(1, math.ceil(actual / 20000))


def _ooxml_pages(archive: zipfile.ZipFile, names: set[str]) -> int | None:
    if "docProps/app.xml" not in names:
        return None
    with archive.open("docProps/app.xml") as handle:
        text = handle.read(256 * 1024)
    match = re.search(rb"<(?:Pages|Slides)>(\d+)</", text)
    return int(match.group(1)) if match else None


def inspect_ole(path: Path, findings: dict[str, Any]) -> None:
    """An OLE2 compound file: legacy Office, or an encrypted OOXML package."""
    with open(path, "rb") as handle:
        sample = handle.read(4 * 1024 * 1024)
    if OLE_ENCRYPTION_STREAM in sample or findings["extension"] in ("docx", "xlsx", "pptx"):
        findings["encrypted"] = True
        quarantine(findings, "encrypted_document", "the document is password-protected")
        return
    findings["family"] = DOCUMENT
    findings["pages"] = max(1, math.ceil(findings["size"] / 20000))


def inspect_pdf(path: Path, findings: dict[str, Any]) -> None:
    size = findings["size"]
    with open(path, "rb") as handle:
        body = handle.read(PDF_SCAN_BYTES)
        handle.seek(max(size - 2048, 0))
        tail = handle.read(2048)
    if b"%%EOF" not in tail:
        quarantine(findings, "corrupt_file", "the PDF is truncated (no end-of-file marker)")
        return
    if b"startxref" not in tail:
        quarantine(findings, "corrupt_file", "the PDF has no cross-reference pointer")
        return
    if re.search(rb"/Encrypt\s", tail) or re.search(rb"/Encrypt\s+\d+\s+\d+\s+R", body[-65536:]):
        findings["encrypted"] = True
        quarantine(findings, "encrypted_document", "the PDF is encrypted")
        return
    pages = len(PAGE_MARKER.findall(body))
    if size > PDF_SCAN_BYTES and pages:
        pages = math.ceil(pages * size / PDF_SCAN_BYTES)
        findings["notes"].append("page count extrapolated from the first 64 MiB")
    if pages == 0:
        findings["risk"] = "unknown"
        findings["notes"].append("no page objects found")
    findings["pages"] = pages or None


def inspect_audio(path: Path, findings: dict[str, Any]) -> None:
    try:
        audio = mutagen.File(path)
    except Exception:
        audio = None
    length = getattr(getattr(audio, "info", None), "length", None)
    if audio is None or not length or length <= 0:
        if findings["family"] == AUDIO:
            quarantine(findings, "corrupt_file", "the audio headers are damaged or carry no duration")
        return
    # Constant-bitrate formats must be about as long as their headers say (Ogg/FLAC declare a
    # nominal rate only, so they are not judged this way).
    bitrate = getattr(audio.info, "bitrate", 0) or 0
    constant = type(audio).__name__ in ("MP3", "EasyMP3", "WAVE")
    if constant and bitrate and findings["size"] < length * bitrate / 8 * 0.5:
        quarantine(findings, "corrupt_file", "the audio is truncated: far shorter than its headers declare")
        return
    if _wav_truncated(path, findings["size"]):
        quarantine(findings, "corrupt_file", "the WAV data chunk runs past the end of the file")
        return
    findings["family"] = AUDIO
    findings["audio_minutes"] = round(length / 60.0, 3)


def _wav_truncated(path: Path, size: int) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(12)
        if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return False
        offset = 12
        while offset + 8 <= size:
            handle.seek(offset)
            chunk = handle.read(8)
            if len(chunk) < 8:
                return True
            name, length = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if name == b"data":
                return offset + 8 + length > size + 1
            offset += 8 + length + (length & 1)
        return True
