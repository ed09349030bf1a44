"""What a file is, judged by its content (signature), never by its name.

The name's extension is kept only to notice a mismatch (an executable renamed .wav).
"""

from __future__ import annotations

from dataclasses import dataclass

import filetype

AUDIO = "audio"
DOCUMENT = "document"
TEXT = "text"
ARCHIVE = "archive"
EXECUTABLE = "executable"
MEDIA = "media"
UNKNOWN = "unknown"

OOXML = {
    "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
    "pptx": "application/vnd.openxmlformats-officedocument.presentationml.presentation",
}
FAMILY_BY_MIME = {
    "audio/x-wav": AUDIO, "audio/mpeg": AUDIO, "audio/x-flac": AUDIO, "audio/ogg": AUDIO, "audio/mp4": AUDIO,
    "audio/aac": AUDIO, "audio/x-aiff": AUDIO, "audio/amr": AUDIO,
    "application/pdf": DOCUMENT, "application/msword": DOCUMENT, "application/vnd.ms-excel": DOCUMENT,
    "application/vnd.ms-powerpoint": DOCUMENT, "application/rtf": DOCUMENT,
    "application/vnd.oasis.opendocument.text": DOCUMENT,
    "application/vnd.oasis.opendocument.spreadsheet": DOCUMENT,
    "application/vnd.oasis.opendocument.presentation": DOCUMENT,
    "application/epub+zip": DOCUMENT,
    **{mime: DOCUMENT for mime in OOXML.values()},
    "text/plain": TEXT, "text/html": TEXT, "application/json": TEXT,
    "application/zip": ARCHIVE, "application/x-tar": ARCHIVE, "application/gzip": ARCHIVE,
    "application/x-rar-compressed": ARCHIVE, "application/x-7z-compressed": ARCHIVE, "application/x-bzip2": ARCHIVE,
    "application/x-xz": ARCHIVE, "application/zstd": ARCHIVE,
    "application/x-msdownload": EXECUTABLE, "application/x-executable": EXECUTABLE,
    "application/x-mach-binary": EXECUTABLE, "application/wasm": EXECUTABLE, "application/x-deb": EXECUTABLE,
    "application/x-rpm": EXECUTABLE, "application/x-shockwave-flash": EXECUTABLE,
}
# Extensions a tenant may label a file with, by the family their content must have.
EXTENSION_FAMILY = {
    **{ext: AUDIO for ext in ("wav", "mp3", "flac", "ogg", "oga", "opus", "m4a", "aac", "aiff", "aif", "amr")},
    **{ext: DOCUMENT for ext in ("pdf", "doc", "docx", "xls", "xlsx", "ppt", "pptx", "odt", "ods", "odp", "rtf", "epub")},
    **{ext: TEXT for ext in ("txt", "md", "html", "htm", "csv", "json")},
}
# Families whose content we accept for storage. Executables and archives are stored so the
# pre-check can quarantine them visibly; plain media (images, video, fonts) is refused at once.
ACCEPTED_AT_UPLOAD = {AUDIO, DOCUMENT, TEXT, ARCHIVE, EXECUTABLE, UNKNOWN}
INPUT_FAMILIES = {"transcription": {AUDIO}, "conversion": {DOCUMENT, TEXT}}
TARGET_FORMATS = {"transcription": ("txt", "json", "srt", "vtt"), "conversion": ("pdf", "txt", "html", "md")}
KINDS = tuple(TARGET_FORMATS)


@dataclass(frozen=True)
class Sniffed:
    mime: str
    family: str


def sniff(head: bytes) -> Sniffed:
    """Classify by signature from the first bytes of a file."""
    if head.startswith(b"\x7fELF"):
        return Sniffed("application/x-executable", EXECUTABLE)
    if head[:4] in (b"\xfe\xed\xfa\xce", b"\xfe\xed\xfa\xcf", b"\xce\xfa\xed\xfe", b"\xcf\xfa\xed\xfe"):
        return Sniffed("application/x-mach-binary", EXECUTABLE)
    if head.startswith(b"#!"):
        return Sniffed("text/x-shellscript", EXECUTABLE)
    if head.startswith(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"):
        # OLE2 compound file: legacy Office, or an encrypted OOXML document.
        return Sniffed("application/x-ole-storage", DOCUMENT)
    kind = filetype.guess(head)
    if kind is not None:
        mime = kind.mime
        family = FAMILY_BY_MIME.get(mime)
        if family is None:
            top = mime.split("/", 1)[0]
            family = MEDIA if top in ("image", "video", "font") else UNKNOWN
        return Sniffed(mime, family)
    if _looks_like_text(head):
        stripped = head.lstrip().lower()
        if stripped.startswith(b"<!doctype html") or stripped.startswith(b"<html"):
            return Sniffed("text/html", TEXT)
        return Sniffed("text/plain", TEXT)
    return Sniffed("application/octet-stream", UNKNOWN)


def _looks_like_text(head: bytes) -> bool:
    if not head or b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
        return True
    except UnicodeDecodeError as exc:
        # A multi-byte character cut at the end of the sample is still text.
        return exc.start >= len(head) - 3


def extension_of(label: str) -> str:
    name = label.rsplit("/", 1)[-1].rsplit("\\", 1)[-1]
    if "." not in name:
        return ""
    ext = name.rsplit(".", 1)[1].lower()
    return ext[:16] if ext.isalnum() else ""
