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
        # Readers look for the directory in the last 64 KiB only: more appended content than
        # that hides it. Found further back, the archive is whole and something follows it.
        end = _zip_end_far(path, findings["size"])
        if end is not None and _trailing_payload(path, findings, end, "the ZIP end-of-central-directory record"):
            return
        quarantine(findings, "corrupt_file", "the zip container is damaged")
        return
    with archive:
        if _trailing_payload(path, findings, _zip_end(archive), "the ZIP end-of-central-directory record"):
            return
        infos = archive.infolist()
        first = min((info.header_offset for info in infos), default=0)
        if first > 0:
            # Bytes before the first entry the directory lists are outside the archive too (an
            # archive appended to another is read as the last one, the first left unchecked).
            with open(path, "rb") as handle:
                leading = handle.read(min(first, TRAILING_SCAN_BYTES))
            kind = _payload_kind(leading) or ("other content" if first > TRAILING_ALLOWED_BYTES else None)
            if kind:
                findings["trailing_bytes"] = findings["size"] - first
                quarantine(findings, "trailing_payload", f"{kind} lies outside the archive its directory describes "
                                                         f"({first} bytes before its first entry)")
                return
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


def _zip_end(archive: zipfile.ZipFile) -> int:
    """Where the archive ends: after its end-of-central-directory record and its comment."""
    archive.fp.seek(0, 2)
    end_record = zipfile._EndRecData(archive.fp)
    if not end_record:
        return archive.fp.tell()
    return end_record[zipfile._ECD_LOCATION] + zipfile.sizeEndCentDir + len(end_record[zipfile._ECD_COMMENT])


def _zip_end_far(path: Path, size: int) -> int | None:
    with open(path, "rb") as handle:
        start = max(size - TRAILING_SCAN_BYTES, 0)
        handle.seek(start)
        data = handle.read()
    position = data.rfind(b"PK\x05\x06")
    while position >= 0:
        record = data[position:position + zipfile.sizeEndCentDir]
        if len(record) == zipfile.sizeEndCentDir:
            comment = struct.unpack("<H", record[20:22])[0]
            entries, directory_size, directory_offset = struct.unpack("<HII", record[10:20])
            # A real record: its directory lies just before it.
            if entries and directory_offset + directory_size <= start + position:
                return start + position + zipfile.sizeEndCentDir + comment
        position = data.rfind(b"PK\x05\x06", 0, position)
    return None


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
    end = _pdf_end(path, size)
    if end is None:
        quarantine(findings, "corrupt_file", "the PDF is truncated (no end-of-file marker)")
        return
    if _trailing_payload(path, findings, end, "the PDF's last %%EOF"):
        return
    with open(path, "rb") as handle:
        handle.seek(max(end - 2048, 0))
        tail = handle.read(min(end, 2048))
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


def _pdf_end(path: Path, size: int) -> int | None:
    """Where the PDF ends: just after its last %%EOF marker (searched backwards, bounded)."""
    block, position = 1024 * 1024, size
    with open(path, "rb") as handle:
        while position > 0 and size - position < TRAILING_SCAN_BYTES:
            start = max(position - block, 0)
            handle.seek(start)
            data = handle.read(position - start + 5)  # overlap: a marker may straddle two blocks
            found = data.rfind(b"%%EOF")
            if found >= 0:
                after = data[found + 5:found + 7]  # the end-of-line that ends the marker's line
                eol = 2 if after == b"\r\n" else 1 if after[:1] in (b"\r", b"\n") else 0
                return start + found + 5 + eol
            position = start
    return None


# --- content after the container --------------------------------------------------------------
# A container declares where it ends (RIFF's size, a PDF's last %%EOF, a ZIP's end of central
# directory). What follows is ignored by readers of the format and so is a place to smuggle a
# program or an archive past a check that only looks at the front.
TRAILING_SCAN_BYTES = 64 * 1024 * 1024
TRAILING_ALLOWED_BYTES = 64 * 1024
PAYLOAD_SIGNATURES = {
    b"\x7fELF": "an ELF executable",
    b"PK\x03\x04": "a ZIP archive",
    b"7z\xbc\xaf\x27\x1c": "a 7-Zip archive",
    b"Rar!\x1a\x07": "a RAR archive",
    b"\x1f\x8b\x08": "a gzip stream",
    b"\xcf\xfa\xed\xfe": "a Mach-O executable",
    b"\xfe\xed\xfa\xcf": "a Mach-O executable",
    b"\xca\xfe\xba\xbe": "a Mach-O universal executable",
    b"MSCF": "a CAB archive",
    b"%PDF-": "another PDF",
}


def _trailing_payload(path: Path, findings: dict[str, Any], end: int, what: str) -> bool:
    """Quarantine (True) when what follows `end` carries a program or an archive, or is more
    than a few padding bytes' worth; a small tail of padding or tags is noted only."""
    size = findings["size"]
    trailing = size - end
    if trailing <= 0:
        return False
    with open(path, "rb") as handle:
        handle.seek(end)
        data = handle.read(min(trailing, TRAILING_SCAN_BYTES))
    findings["trailing_bytes"] = trailing
    kind = _payload_kind(data)
    if kind:
        quarantine(findings, "trailing_payload", f"{kind} follows {what} ({trailing} bytes after the end)")
        return True
    if len(data.strip(b"\x00\r\n\t ")) > TRAILING_ALLOWED_BYTES:
        quarantine(findings, "trailing_payload", f"{trailing} bytes of other content follow {what}")
        return True
    if data.strip(b"\x00\r\n\t "):
        findings["notes"].append(f"{trailing} bytes after {what} (ignored)")
    return False


def _payload_kind(data: bytes) -> str | None:
    for signature, kind in PAYLOAD_SIGNATURES.items():
        if signature in data:
            return kind
    stripped = data.lstrip(b"\x00\r\n\t ")
    if stripped.startswith(b"#!"):
        return "a script"
    # A Windows program: "MZ" whose header points at a "PE\0\0" signature.
    for match in re.finditer(rb"MZ", data):
        start = match.start()
        if start + 0x40 <= len(data):
            pe = struct.unpack("<I", data[start + 0x3C:start + 0x40])[0]
            if data[start + pe:start + pe + 4] == b"PE\x00\x00":
                return "a Windows executable"
    return None


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
    riff_end = _riff_end(path)
    if riff_end is not None and _trailing_payload(path, findings, riff_end, "the RIFF chunk's declared end"):
        return
    findings["family"] = AUDIO
    findings["audio_minutes"] = round(length / 60.0, 3)


def _riff_end(path: Path) -> int | None:
    with open(path, "rb") as handle:
        head = handle.read(12)
    if head[:4] != b"RIFF" or len(head) < 12:
        return None
    declared = struct.unpack("<I", head[4:8])[0]
    return 8 + declared + (declared & 1)


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
