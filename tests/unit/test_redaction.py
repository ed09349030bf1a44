"""Logs carry whitelisted fields only: never filenames, contents, tokens or exception texts."""

import json
import logging

from tasks.observability import JsonFormatter, log_event


def render(record: logging.LogRecord) -> dict:
    return json.loads(JsonFormatter().format(record))


def capture(func) -> list[logging.LogRecord]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    logger = logging.getLogger("sluice")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        func()
    finally:
        logger.removeHandler(handler)
    return records


def test_fields_outside_the_whitelist_are_dropped():
    records = capture(lambda: log_event("upload", task_id="t1", filename="secret-plan.wav", token="slu_abc",
                                        body="file bytes", callback_body="{}", size=12))
    entry = render(records[0])
    assert entry["task_id"] == "t1" and entry["size"] == 12
    for banned in ("secret-plan", "slu_abc", "file bytes", "callback_body", "filename"):
        assert banned not in json.dumps(entry)


def test_exceptions_are_reduced_to_their_class():
    records = capture(lambda: log_event("failed", exception=ValueError("contents of /tmp/secret-plan.wav")))
    assert render(records[0])["exception"] == "ValueError"


def test_foreign_log_records_keep_their_template_not_their_arguments():
    record = logging.LogRecord("django.request", logging.WARNING, __file__, 1, "Not Found: %s", ("/api/v1/tasks/secret-plan",), None)
    entry = render(record)
    assert entry["message"] == "Not Found: %s" and "secret-plan" not in json.dumps(entry)


def test_exception_text_of_a_foreign_record_is_never_rendered():
    try:
        raise RuntimeError("token slu_topsecret leaked")
    except RuntimeError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom", (), sys.exc_info())
    entry = render(record)
    assert entry["exception"] == "RuntimeError" and "slu_topsecret" not in json.dumps(entry)
