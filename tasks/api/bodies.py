"""Request bodies read within bounds: JSON read up to a limit, uploads streamed, chunked transfer
(no Content-Length) read from the server's decoded stream, multipart file names kept as labels
but never used as names on disk."""

from __future__ import annotations

import os
from collections.abc import Iterator

from django.conf import settings
from django.core.files.uploadhandler import MemoryFileUploadHandler, TemporaryFileUploadHandler
from django.core.handlers.wsgi import LimitedStream
from django.http import HttpRequest

from tasks.errors import PayloadTooLarge

# A body somewhat over its limit is read and dropped before the refusal, so the client, still
# sending, hears the 413 instead of a reset connection; a far larger one is refused at once.
DRAIN_BYTES = 16 * 1024 * 1024


def drain(request: HttpRequest) -> None:
    """Read and drop what is left of a refused body, if it is not far too large."""
    length = request.META.get("CONTENT_LENGTH") or ""
    if length.isdigit() and int(length) <= DRAIN_BYTES:
        try:
            while request.read(64 * 1024):
                pass
        except Exception:  # already read, or the client went away: nothing left to drop
            pass


def body_read(request: HttpRequest, *, limit: int) -> bytes:
    length = request.META.get("CONTENT_LENGTH") or ""
    if length.isdigit() and int(length) > limit:
        drain(request)
        raise PayloadTooLarge(f"The body is larger than {limit} bytes.")
    data = request.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLarge(f"The body is larger than {limit} bytes.")
    return data


def body_chunks(request: HttpRequest, size: int) -> Iterator[bytes]:
    while chunk := request.read(size):
        yield chunk


class ChunkedBodies:
    """A body sent with `Transfer-Encoding: chunked` has no Content-Length, and Django reads such
    a body as empty. The server (gunicorn) decodes the chunks; this reads them, up to the largest
    upload accepted, and marks the request so multipart parsing can refuse it clearly."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest):
        chunked = "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower()
        if chunked and not request.META.get("CONTENT_LENGTH") and "wsgi.input" in request.META:
            # Only uploads may be large; any other body is cut just past the largest accepted,
            # so reading it whole (request.body) stays bounded and is then refused as too large.
            upload = request.path == "/api/v1/files"
            limit = int(settings.MAX_UPLOAD_BYTES) + 1024 * 1024 if upload else settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1
            request._stream = LimitedStream(request.META["wsgi.input"], limit)
            request.sluice_chunked = True
        return self.get_response(request)


def safe_upload_name(name: str) -> str:
    """A short name for the temporary file; the sender's name is only ever a label."""
    stem, ext = os.path.splitext(os.path.basename(name or ""))
    return (stem[:64] or "upload") + (ext[:12] if ext[1:].isalnum() else "")


MAX_LABEL = 255


def upload_label(upload) -> str:
    """The name the sender gave the file (kept as a label only, never as a path)."""
    return getattr(upload, "sluice_label", None) or upload.name or ""


class _Labelled:
    sluice_label = ""

    def new_file(self, field_name, file_name, *args, **kwargs):
        self.sluice_label = file_name or ""
        return super().new_file(field_name, safe_upload_name(file_name), *args, **kwargs)

    def file_complete(self, file_size):
        file = super().file_complete(file_size)
        if file is not None:
            file.sluice_label = self.sluice_label
        return file


class LabelledMemoryUpload(_Labelled, MemoryFileUploadHandler):
    pass


class LabelledTemporaryUpload(_Labelled, TemporaryFileUploadHandler):
    pass
