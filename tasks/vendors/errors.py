"""Exceptions raised by the vendor client, already classified where they enter the code."""

from __future__ import annotations

from tasks.vendors.classification import Failure, Outcome, Row


class VendorError(Exception):
    """A vendor call failed; `outcome` says what that proves."""

    def __init__(
        self,
        row: Row,
        *,
        operation: str,
        status: int | None = None,
        code: str | None = None,
        error_class: str = "",
        retry_after_s: float | None = None,
        bytes_sent: int = 0,
        detail: str = "",
    ) -> None:
        super().__init__(f"{row.message}: {detail}" if detail else row.message)
        self.detail = detail
        self.row = row
        self.outcome: Outcome = row.outcome
        self.operation = operation
        self.status = status
        self.code = code or (f"http_{status}" if status else error_class.lower() or "vendor_error")
        self.error_class = error_class or (f"HTTP{status}" if status else "")
        self.retry_after_s = retry_after_s
        self.bytes_sent = bytes_sent

    @property
    def message(self) -> str:
        return f"{self.row.message}: {self.detail}" if self.detail else self.row.message

    @property
    def is_timeout(self) -> bool:
        return "Timeout" in self.error_class or self.error_class == "UploadDeadlineExceeded"

    @property
    def failure(self) -> Failure:
        return Failure(
            outcome=self.outcome, code=self.code, message=self.message, error_class=self.error_class,
            retry_after_s=self.retry_after_s, flow_control=self.row.flow_control, timeout=self.is_timeout,
            breaker_open=self.error_class == "BreakerOpen", unavailable=self.row.unavailable,
        )


class UploadDeadlineExceeded(Exception):
    """The whole upload took longer than its wall-clock deadline."""


class DownloadDeadlineExceeded(Exception):
    """The whole download took longer than its wall-clock deadline."""


class MalformedResponse(Exception):
    """The vendor answered success with a body that is not what the contract promises."""


class BreakerOpen(Exception):
    """The channel's circuit breaker does not permit a call now."""

    def __init__(self, retry_in_s: float | None) -> None:
        super().__init__("circuit breaker open")
        self.retry_in_s = retry_in_s


class StopUpload(Exception):
    """The attempt was fenced or cancelled between two chunks; stop sending."""
