"""Where file contents live: under SLUICE_DATA_DIR (the embedded default), or in an S3-compatible
bucket through Django's storage API (django-storages) when SLUICE_STORAGE_URL is s3://bucket/prefix.
Names derive from ids, never from client-supplied names.

Stored files are `files/<id>`, results `results/<task>/<attempt>.out`. With a bucket:
- a stored file is streamed into it while hashed (multipart above 8 MiB, so memory stays flat):
  the object exists only once the upload completed, a failed one leaves nothing;
- a step that needs the bytes on disk (a vendor upload, a pre-check, a conversion) gets a local
  copy for the time it needs it (`local_copy`), downloaded in parts;
- a result is fetched to a local scratch file, verified, then put in the bucket before the task
  is published as SUCCEEDED; a failure to store it is retried like a failed download;
- a download is a redirect to a pre-signed link that lives as long as Sluice's signed links.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from tasks.errors import EmptyFile, FileTooLarge, StorageUnavailable

CHUNK = 64 * 1024
PART_BYTES = 8 * 1024 * 1024
_buckets: dict[tuple, Any] = {}


def bucket_storage() -> Any | None:
    """The configured bucket as a Django storage, or None for local files."""
    url = settings.STORAGE_URL
    if not url:
        return None
    key = (os.getpid(), url, settings.S3_ENDPOINT_URL, settings.S3_REGION)
    store = _buckets.get(key)
    if store is None:
        from boto3.s3.transfer import TransferConfig
        from storages.backends.s3 import S3Storage

        # Two parts in memory at most, two uploading: memory does not grow with the file.
        transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=2,
                                  use_threads=True)
        transfer.max_in_memory_upload_chunks = 2  # s3transfer's own knob (boto3's constructor lacks it)
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"SLUICE_STORAGE_URL must be s3://bucket/prefix, not {url!r}")
        store = S3Storage(
            bucket_name=parts.netloc, location=parts.path.strip("/"), endpoint_url=settings.S3_ENDPOINT_URL or None,
            region_name=settings.S3_REGION, addressing_style="path", file_overwrite=True, default_acl=None,
            querystring_auth=True, querystring_expire=int(settings.SIGNED_URL_TTL_S), signature_version="s3v4",
            transfer_config=transfer,
        )
        _buckets[key] = store
    return store


class _HashingReader:
    """A file-like view of chunks that hashes, counts and bounds them as they are read."""

    def __init__(self, chunks: Iterable[bytes], max_bytes: int) -> None:
        self._chunks = iter(chunks)
        self._buffer = b""
        self.digest = hashlib.sha256()
        self.size = 0
        self.head = b""
        self.max_bytes = max_bytes

    def read(self, size: int = -1) -> bytes:
        pieces, have = ([self._buffer] if self._buffer else []), len(self._buffer)
        while size < 0 or have < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self.size += len(chunk)
            if self.size > self.max_bytes:
                raise FileTooLarge(f"The file is larger than {self.max_bytes} bytes.")
            if len(self.head) < 8192:
                self.head += chunk[: 8192 - len(self.head)]
            self.digest.update(chunk)
            pieces.append(chunk)
            have += len(chunk)
        data = b"".join(pieces)
        if size < 0 or len(data) <= size:
            self._buffer = b""
            return data
        self._buffer = data[size:]
        return data[:size]

    closed = False

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class StoredBlob:
    storage_name: str
    sha256: str
    size: int
    head: bytes


def store_stream(chunks: Iterable[bytes], *, max_bytes: int) -> StoredBlob:
    """Write chunks to a new file while hashing; memory does not grow with the size."""
    file_id = uuid.uuid4().hex
    storage_name = f"{file_id[:2]}/{file_id}"
    store = bucket_storage()
    if store is not None:
        return _store_in_bucket(store, storage_name, chunks, max_bytes=max_bytes)
    final = Path(settings.FILES_DIR) / storage_name
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_suffix(".partial")
    digest = hashlib.sha256()
    size = 0
    head = b""
    try:
        with open(partial, "wb") as out:
            for chunk in chunks:
                if not chunk:
                    continue
                size += len(chunk)
                if size > max_bytes:
                    raise FileTooLarge(f"The file is larger than {max_bytes} bytes.")
                if len(head) < 8192:
                    head += chunk[: 8192 - len(head)]
                digest.update(chunk)
                out.write(chunk)
        if size == 0:
            raise EmptyFile()
        os.replace(partial, final)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return StoredBlob(storage_name=storage_name, sha256=digest.hexdigest(), size=size, head=head)


def _store_in_bucket(store: Any, storage_name: str, chunks: Iterable[bytes], *, max_bytes: int) -> StoredBlob:
    from django.core.files import File

    reader = _HashingReader(chunks, max_bytes)
    try:
        store.save(f"files/{storage_name}", File(reader, name=storage_name))
    except (FileTooLarge, EmptyFile):
        raise
    except Exception as exc:
        if isinstance(exc, _client_errors()):
            raise StorageUnavailable(f"The object store did not take the file ({type(exc).__name__}); nothing was kept. "
                                     "Send it again.", retry_after=5) from None
        raise
    if reader.size == 0:
        store.delete(f"files/{storage_name}")
        raise EmptyFile()
    return StoredBlob(storage_name=storage_name, sha256=reader.digest.hexdigest(), size=reader.size, head=reader.head)


def _client_errors() -> tuple[type[BaseException], ...]:
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    return (Boto3Error, BotoCoreError, ClientError, OSError)


@contextlib.contextmanager
def local_copy(storage_name: str, *, on_progress: Any = None) -> Iterator[Path]:
    """The stored file's bytes on this host's disk for as long as the block runs (in place for
    local files; a temporary copy, downloaded in parts, from a bucket). `on_progress(bytes)` is
    called in this thread as the copy arrives (a step's lease heartbeat)."""
    store = bucket_storage()
    if store is None:
        yield Path(settings.FILES_DIR) / storage_name
        return
    scratch = Path(settings.FILE_UPLOAD_TEMP_DIR)
    scratch.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=scratch, prefix="copy-")
    os.close(handle)
    path = Path(name)
    try:
        from boto3.s3.transfer import TransferConfig

        # In this thread (no transfer threads), so the progress callback may touch the database.
        config = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, use_threads=False)
        try:
            store.bucket.download_file(store._normalize_name(f"files/{storage_name}"), str(path), Config=config,
                                       Callback=on_progress)
        except _client_errors() as exc:
            raise StorageUnavailable(f"the object store did not give the file: {type(exc).__name__}") from None
        yield path
    finally:
        path.unlink(missing_ok=True)


def open_stored(storage_name: str) -> Any:
    """The stored file opened for reading (a stream; from a bucket, spooled as it is read);
    FileNotFoundError when it is gone, StorageUnavailable when the store does not answer."""
    store = bucket_storage()
    if store is None:
        return open(Path(settings.FILES_DIR) / storage_name, "rb")
    try:
        if not store.exists(f"files/{storage_name}"):
            raise FileNotFoundError(storage_name)
        handle = store.open(f"files/{storage_name}", "rb")
        handle.read(0)  # fetched now, so a failing store is seen here and not mid-response
        return handle
    except _client_errors() as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise StorageUnavailable(f"The object store did not give the file ({type(exc).__name__}).") from None


def stored_exists(storage_name: str) -> bool:
    store = bucket_storage()
    return (Path(settings.FILES_DIR) / storage_name).exists() if store is None else store.exists(f"files/{storage_name}")


def delete_stored(storage_name: str) -> None:
    store = bucket_storage()
    if store is None:
        (Path(settings.FILES_DIR) / storage_name).unlink(missing_ok=True)
    else:
        store.delete(f"files/{storage_name}")


def publish_result(path: Path) -> str:
    """Keep a verified result (fetched to `path`) where downloads find it; its relative name.
    With a bucket the file is uploaded (StorageUnavailable if not) and the local copy removed."""
    relative = relative_result(path)
    store = bucket_storage()
    if store is None:
        return relative
    try:
        with open(path, "rb") as handle:
            store.save(f"results/{relative}", handle)
    except _client_errors() as exc:
        raise StorageUnavailable(f"the object store did not take the result: {type(exc).__name__}") from None
    path.unlink(missing_ok=True)
    return relative


def discard_result(relative: str) -> None:
    """Remove a result nobody will be given (a late attempt's, an expired one)."""
    store = bucket_storage()
    if store is None:
        result_file(relative).unlink(missing_ok=True)
        return
    try:
        store.delete(f"results/{relative}")
    except _client_errors() as exc:
        raise StorageUnavailable(f"the object store did not delete the result: {type(exc).__name__}") from None


def result_exists(relative: str) -> bool:
    store = bucket_storage()
    if store is None:
        return result_file(relative).exists()
    try:
        return store.exists(f"results/{relative}")
    except _client_errors() as exc:
        raise StorageUnavailable(f"The object store did not answer ({type(exc).__name__}); try again.",
                                 retry_after=5) from None


def stored_results(task_id: object | None = None) -> Iterator[tuple[str, float]]:
    """Every kept result (of one task, or all) as (relative name, last modified in epoch seconds):
    the bucket's objects when there is one, else the files under RESULTS_DIR."""
    store = bucket_storage()
    if store is None:
        root = Path(settings.RESULTS_DIR)
        for path in root.glob(f"{task_id}/*" if task_id is not None else "*/*") if root.exists() else ():
            if path.is_file():
                yield str(path.relative_to(root)), path.stat().st_mtime
        return
    base = f"{store.location.strip('/')}/results/" if store.location else "results/"
    try:
        for item in store.bucket.objects.filter(Prefix=base + (f"{task_id}/" if task_id is not None else "")):
            yield item.key[len(base):], item.last_modified.timestamp()
    except _client_errors() as exc:
        raise StorageUnavailable(f"The object store did not answer ({type(exc).__name__}); try again.",
                                 retry_after=5) from None


def result_link(relative: str, *, filename: str, content_type: str) -> str | None:
    """A pre-signed link to the result in the bucket (None for local files: they are streamed)."""
    store = bucket_storage()
    if store is None:
        return None
    return store.url(f"results/{relative}", parameters={
        "ResponseContentDisposition": f'attachment; filename="{filename}"', "ResponseContentType": content_type})


def attempt_result_path(task_id: object, generation: int) -> Path:
    """A fresh, attempt-specific place for a result: only a committed attempt's file is published."""
    return Path(settings.RESULTS_DIR) / str(task_id) / f"g{generation}-{uuid.uuid4().hex[:8]}.out"


def relative_result(path: Path) -> str:
    return str(path.relative_to(settings.RESULTS_DIR))


def result_file(relative: str) -> Path:
    return Path(settings.RESULTS_DIR) / relative


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
