"""Where file contents live on disk. Paths derive from ids, never from client-supplied names."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from tasks.errors import EmptyFile, FileTooLarge

CHUNK = 64 * 1024


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
