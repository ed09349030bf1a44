"""Files made in the tests: real audio and documents, and hostile ones (never downloaded)."""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile


def wav(seconds: float = 2.0, rate: int = 8000, marker: bytes = b"") -> bytes:
    frames = int(seconds * rate)
    data = b"".join(struct.pack("<h", int(2000 * math.sin(i / 7))) for i in range(frames)) + marker
    header = (
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data" + struct.pack("<I", len(data))
    )
    return header + data


def pdf(pages: int = 2, text: str = "hello") -> bytes:
    from fakevendor.jobs import minimal_pdf

    one = minimal_pdf([text])
    if pages == 1:
        return one
    # Several page objects, each a real /Type /Page entry, with a valid trailer.
    kids = " ".join(f"{3 + i} 0 R" for i in range(pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>".encode()]
    objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>" for _ in range(pages)]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def truncated_pdf() -> bytes:
    whole = pdf(3)
    return whole[: len(whole) // 2]


def docx(paragraphs: int = 3) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", '<?xml version="1.0"?><Types/>')
        archive.writestr("_rels/.rels", "<Relationships/>")
        body = "".join(f"<w:p><w:r><w:t>Paragraph {i}</w:t></w:r></w:p>" for i in range(paragraphs))
        archive.writestr("word/document.xml", f"<w:document><w:body>{body}</w:body></w:document>")
        archive.writestr("docProps/app.xml", "<Properties><Pages>1</Pages></Properties>")
    return buffer.getvalue()


def zip_bomb_docx(unpacked_mb: int = 600) -> bytes:
    """A .docx-looking zip whose one entry unpacks to hundreds of MB of zeros."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        archive.writestr("[Content_Types].xml", '<?xml version="1.0"?><Types/>')
        archive.writestr("word/document.xml", "<w:document/>")
        with archive.open("word/media/blob.bin", "w", force_zip64=True) as member:
            chunk = bytes(1024 * 1024)
            for _ in range(unpacked_mb):
                member.write(chunk)
    return buffer.getvalue()


def elf_executable() -> bytes:
    return b"\x7fELF\x02\x01\x01\x00" + bytes(8) + b"\x02\x00\x3e\x00" + os.urandom(2000)


def encrypted_docx() -> bytes:
    """An OLE2 container carrying an EncryptionInfo stream, as password-protected Office files are."""
    header = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504)
    return header + "EncryptionInfo".encode("utf-16-le") + os.urandom(4096)


def encrypted_pdf() -> bytes:
    whole = pdf(1)
    return whole.replace(b"trailer\n<< /Size", b"trailer\n<< /Encrypt 9 0 R /Size")


def text(size: int = 2000) -> bytes:
    return (b"Plain text document line.\n" * (size // 26 + 1))[:size]
