"""Jobs of the fake vendor: status over time, JSON views, billing units and deterministic results."""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from faker import Faker

PAGE_MARKER = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")
CONTENT_TYPES = {
    "txt": "text/plain; charset=utf-8",
    "json": "application/json",
    "srt": "application/x-subrip",
    "vtt": "text/vtt",
    "pdf": "application/pdf",
    "html": "text/html; charset=utf-8",
    "md": "text/markdown; charset=utf-8",
}
KINDS = ("transcription", "conversion")
TARGETS = {"transcription": ("txt", "json", "srt", "vtt"), "conversion": ("pdf", "txt", "html", "md")}


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=UTC).isoformat().replace("+00:00", "Z")


def job_status(job: dict[str, Any], now: float) -> str:
    # canceled_at is only ever set to a moment before the job would have ended.
    if job.get("canceled_at") is not None and now >= job["canceled_at"]:
        return "canceled"
    if now < job["start_at"]:
        return "queued"
    if now < job["end_at"]:
        return "processing"
    return "failed" if job.get("fail_code") else "completed"


def job_end(job: dict[str, Any]) -> float:
    """When the job stopped occupying the vendor (cancel or end)."""
    if job.get("canceled_at") is not None:
        return min(job["canceled_at"], job["end_at"])
    return job["end_at"]


def job_view(job: dict[str, Any], now: float) -> dict[str, Any]:
    status = job_status(job, now)
    span = max(job["end_at"] - job["start_at"], 1e-6)
    progress = 0 if status == "queued" else 100 if status in ("completed", "failed") else int(
        min(99, max(0, (now - job["start_at"]) / span * 100))
    )
    result = None
    if status == "completed":
        sha = job.get("result_sha256") or ""
        if job.get("digest_mismatch"):
            sha = _flip(sha)
        result = {"size": job.get("result_size"), "sha256": sha, "content_type": job.get("result_content_type")}
    error = None
    if status == "failed":
        error = {
            "code": job["fail_code"],
            "message": f"processing failed: {job['fail_code']}",
            "retryable": bool(job.get("fail_retryable")),
        }
    return {
        "id": job["id"],
        "status": status,
        "kind": job["kind"],
        "target_format": job["target_format"],
        "client_ref": job["client_ref"],
        # A vendor that processed another input than it was sent (input_digest_mismatch) says so here.
        "input": {"size": job["input_size"],
                  "sha256": _flip(job["input_sha256"]) if job.get("input_digest_mismatch") else job["input_sha256"]},
        "created_at": rfc3339(job["created_at"]),
        "started_at": rfc3339(job["start_at"]) if status != "queued" else None,
        "completed_at": rfc3339(job["end_at"]) if status in ("completed", "failed") else (
            rfc3339(job["canceled_at"]) if status == "canceled" else None
        ),
        "progress": progress,
        "result": result,
        "error": error,
        "billing": {"units": job["units"], "unit": job["unit"], "amount_cents": job["amount_cents"]},
    }


def _flip(sha: str) -> str:
    if not sha:
        return "0" * 64
    return ("0" if sha[0] != "0" else "1") + sha[1:]


def billing_units(kind: str, path: Path, size: int) -> tuple[float, str]:
    """Started audio minutes or pages, derived from the input where possible."""
    if kind == "transcription":
        seconds = wav_duration_s(path)
        minutes = math.ceil(seconds / 60) if seconds is not None else math.ceil(size / 1_000_000)
        return float(max(minutes, 1)), "audio_minute"
    pages = pdf_pages(path)
    if pages is None:
        pages = math.ceil(size / 50_000)
    return float(max(pages, 1)), "page"


def wav_duration_s(path: Path) -> float | None:
    try:
        with open(path, "rb") as handle:
            header = handle.read(12)
            if len(header) < 12 or header[:4] != b"RIFF" or header[8:12] != b"WAVE":
                return None
            byte_rate = None
            while True:
                chunk = handle.read(8)
                if len(chunk) < 8:
                    return None
                chunk_id, chunk_size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
                if chunk_id == b"fmt ":
                    fmt = handle.read(chunk_size)
                    byte_rate = struct.unpack("<I", fmt[8:12])[0]
                elif chunk_id == b"data":
                    return chunk_size / byte_rate if byte_rate else None
                else:
                    handle.seek(chunk_size + (chunk_size & 1), io.SEEK_CUR)
    except (OSError, struct.error):
        return None


def pdf_pages(path: Path) -> int | None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(16 * 1024 * 1024)
    except OSError:
        return None
    if not head.startswith(b"%PDF-"):
        return None
    return len(PAGE_MARKER.findall(head)) or 1


def generate_result(kind: str, target_format: str, input_sha256: str) -> bytes:
    """Deterministic output: the same input digest and target always give the same bytes."""
    fake = Faker()
    fake.seed_instance(int(input_sha256[:16] or "0", 16))
    sentences = [fake.sentence(nb_words=12) for _ in range(12)]
    if kind == "transcription":
        segments = [{"start": i * 5.0, "end": i * 5.0 + 4.5, "text": s} for i, s in enumerate(sentences)]
        if target_format == "json":
            return json.dumps({"segments": segments, "language": "en"}, indent=1).encode()
        if target_format in ("srt", "vtt"):
            lines = ["WEBVTT", ""] if target_format == "vtt" else []
            for i, seg in enumerate(segments, 1):
                sep = "," if target_format == "srt" else "."
                lines += [str(i), f"{_ts(seg['start'], sep)} --> {_ts(seg['end'], sep)}", seg["text"], ""]
            return "\n".join(lines).encode()
        return ("\n".join(sentences) + "\n").encode()
    if target_format == "pdf":
        return minimal_pdf(sentences)
    if target_format == "html":
        body = "".join(f"<p>{s}</p>" for s in sentences)
        return f"<!doctype html><html><body>{body}</body></html>".encode()
    if target_format == "md":
        return ("# Converted document\n\n" + "\n\n".join(sentences) + "\n").encode()
    return ("\n".join(sentences) + "\n").encode()


def _ts(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, rem = divmod(ms, 3_600_000)
    m, rem = divmod(rem, 60_000)
    s, ms = divmod(rem, 1000)
    return f"{h:02}:{m:02}:{s:02}{sep}{ms:03}"


def minimal_pdf(lines: list[str]) -> bytes:
    """A valid one-page PDF showing `lines` (with a correct cross-reference table)."""
    text = " ".join(f"({line.replace('(', '').replace(')', '')}) Tj T*" for line in lines)
    stream = f"BT /F1 11 Tf 14 TL 50 760 Td {text} ET".encode()
    return write_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ])


def write_pdf(objects: list[bytes]) -> bytes:
    """A PDF file of these numbered objects (1 is the catalog), with a correct cross-reference table."""
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


def fingerprint(*, input_sha256: str, kind: str, target_format: str, client_ref: str, options: Any) -> str:
    canonical = json.dumps(
        [input_sha256, kind, target_format, client_ref, options or {}], sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()
