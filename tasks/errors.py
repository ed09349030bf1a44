"""Errors a caller can act on. Each has a stable code (the API's problem `code`) and an HTTP status;
its docstring is the default message."""

from __future__ import annotations


class SluiceError(Exception):
    """Something went wrong."""

    code = "error"
    status = 400

    def __init__(self, detail: str | None = None, *, retry_after: float | None = None, **extra) -> None:
        super().__init__(detail or (self.__doc__ or "").strip())
        self.detail = detail or (self.__doc__ or "").strip()
        self.retry_after = retry_after
        self.extra = extra


class InvalidRequest(SluiceError):
    """The request is not valid."""

    code, status = "invalid_request", 400


class EmptyFile(SluiceError):
    """The file is empty: send at least one byte."""

    code, status = "empty_file", 400


class FileTooLarge(SluiceError):
    """The file is larger than this installation accepts."""

    code, status = "file_too_large", 413


class UnsupportedType(SluiceError):
    """This kind of file cannot be processed."""

    code, status = "unsupported_type", 415


class FileNotFound(SluiceError):
    """No such file for this tenant: upload it first with POST /api/v1/files."""

    code, status = "file_not_found", 404


class FileQuarantined(SluiceError):
    """This file is quarantined after its pre-check; an operator must release it first."""

    code, status = "file_quarantined", 422


class TaskNotFound(SluiceError):
    """No such task."""

    code, status = "not_found", 404


class OverQuota(SluiceError):
    """The tenant is over a quota."""

    code, status = "over_quota", 429


class BacklogFull(SluiceError):
    """Admission is closed: the lane's backlog is full. Retry later."""

    code, status = "backlog_full", 503


class IdempotencyKeyMismatch(SluiceError):
    """This Idempotency-Key was already used with a different request; use a new key."""

    code, status = "idempotency_key_mismatch", 422


class IdempotencyKeyInUse(SluiceError):
    """A request with this Idempotency-Key is still being accepted; retry shortly."""

    code, status = "idempotency_key_in_use", 409


class AlreadyFinished(SluiceError):
    """The task already reached a final state."""

    code, status = "already_finished", 409


class NotReady(SluiceError):
    """The task has no result yet; wait until it is SUCCEEDED."""

    code, status = "not_ready", 409


class PermissionDenied(SluiceError):
    """You are not allowed to do this."""

    code, status = "forbidden", 403


class PayloadTooLarge(SluiceError):
    """The request body is larger than this endpoint accepts."""

    code, status = "payload_too_large", 413


class InvalidJson(SluiceError):
    """The body is not valid JSON."""

    code, status = "invalid_json", 400


class InvalidMultipart(SluiceError):
    """The multipart body cannot be parsed."""

    code, status = "invalid_multipart", 400


class StorageUnavailable(SluiceError):
    """The object store did not take or give the file; nothing half-written was kept. Try again."""

    code, status = "storage_unavailable", 503
