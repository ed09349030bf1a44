"""Files made on the spot for scenarios and tests: real audio and documents, and hostile ones
(generated, never downloaded)."""

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
    """A valid PDF: one page with text, or `pages` real /Type /Page objects."""
    from fakevendor.jobs import minimal_pdf, write_pdf

    if pages == 1:
        return minimal_pdf([text])
    kids = " ".join(f"{3 + i} 0 R" for i in range(pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>".encode()]
    objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>" for _ in range(pages)]
    return write_pdf(objects)


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


def mp3_like(frames: int = 400) -> bytes:
    """MPEG-1 Layer III frames (128 kbit/s, 44.1 kHz) of silence: enough for a duration from headers."""
    header = b"\xff\xfb\x90\x64"
    frame = header + bytes(417 - 4)
    return frame * frames


def flac(seconds: float = 2.0, rate: int = 8000) -> bytes:
    """A FLAC stream whose STREAMINFO declares the duration (audio frames omitted)."""
    import struct

    total = int(seconds * rate)
    # STREAMINFO: min/max block, min/max frame, 20 bits rate, 3 bits channels-1, 5 bits bps-1, 36 bits samples, md5
    packed = (rate << 44) | (0 << 41) | (15 << 36) | total
    info = struct.pack(">HH", 4096, 4096) + b"\x00\x00\x00" * 2 + packed.to_bytes(8, "big") + bytes(16)
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info


def ogg_vorbis(seconds: float = 2.0, rate: int = 8000) -> bytes:
    """An Ogg Vorbis identification header page plus a last page carrying the granule position."""
    import struct

    def page(granule: int, sequence: int, payload: bytes, header_type: int) -> bytes:
        segments = [255] * (len(payload) // 255) + [len(payload) % 255]
        head = (b"OggS" + bytes([0, header_type]) + struct.pack("<qII", granule, 1, sequence) + b"\x00\x00\x00\x00"
                + bytes([len(segments)]) + bytes(segments))
        crc = _ogg_crc(head + payload)
        return head[:22] + struct.pack("<I", crc) + head[26:] + payload

    ident = b"\x01vorbis" + struct.pack("<IBIiii", 0, 1, rate, 0, 64000, 0) + b"\xb8\x01"
    comment = b"\x03vorbis" + struct.pack("<I", 6) + b"sluice" + struct.pack("<I", 0) + b"\x01"
    return page(0, 0, ident, 0x02) + page(0, 1, comment, 0) + page(int(seconds * rate), 2, b"\x00" * 8, 0x04)


def _ogg_crc(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
    return crc


def with_marker(content: bytes, marker: bytes) -> bytes:
    """The same file with a marker appended (hostile detector triggers, distinctive content)."""
    return content + marker


def zip_bomb_lying_headers(unpacked_mb: int = 64) -> bytes:
    """A .docx-looking zip whose headers claim a tiny entry that really unpacks to many MB."""
    import struct

    honest = zip_bomb_docx(unpacked_mb)
    real = unpacked_mb * 1024 * 1024
    fake = struct.pack("<I", 1024)
    data = bytearray(honest)
    needle = struct.pack("<I", real)
    index = data.find(needle)
    while index != -1:
        data[index:index + 4] = fake
        index = data.find(needle, index + 4)
    return bytes(data)


def windows_executable() -> bytes:
    """A minimal PE image: an "MZ" header whose e_lfanew points at the "PE\\0\\0" signature."""
    header = bytearray(b"MZ" + b"\x90" * 0x3A + (0x80).to_bytes(4, "little"))
    header += b"\x00" * (0x80 - len(header)) + b"PE\x00\x00" + b"\x4c\x01" + b"\x00" * 250
    return bytes(header)


def with_trailing(container: bytes, payload: bytes) -> bytes:
    """A container with something appended after its declared end (readers of the format ignore it)."""
    return container + payload
