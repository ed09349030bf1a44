"""Counted costs, for the benchmark: SQL statements and queue messages, per process.

Off unless SLUICE_COUNT_DIR names a directory. Then every process of the system counts each SQL
statement it executes and each queue message it sends, and writes its totals to
`<dir>/<pid>.json` at most every half second (and when asked): a benchmark sums the files before
and after a run and divides by the tasks it ran. Counting is a few integer additions. Of a
statement only its kind is kept (its verb and first table, `sql:UPDATE tasks_task`), so the
benchmark can say where the statements go; never its parameters.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

FLUSH_S = 0.5
_counts = {"statements": 0, "queue_messages": 0}
_lock = threading.Lock()
_last_flush = [0.0]
_written = [""]  # what this process last wrote
_flushing = [False]  # this process's flusher has started


def directory() -> Path | None:
    raw = os.environ.get("SLUICE_COUNT_DIR")
    if raw != _directory[0]:  # asked for at every statement: the path is made when it changes
        _directory[:] = [raw, Path(raw) if raw else None]
    return _directory[1]


_directory: list[Any] = [None, None]


def count(kind: str, n: int = 1) -> None:
    if directory() is None:
        return
    with _lock:
        _counts[kind] = _counts.get(kind, 0) + n
    if not _flushing[0]:
        _start_flusher()
    if time.monotonic() - _last_flush[0] >= FLUSH_S:
        flush()


def flush() -> None:
    """Write this process's totals; never raises (counting must not fail what it counts)."""
    folder = directory()
    if folder is None:
        return
    _last_flush[0] = time.monotonic()
    with _lock:  # one writer per process at a time (a threaded web server counts from many)
        data = json.dumps(_counts)
        if data == _written[0]:
            return  # nothing counted since: an idle process writes nothing
        target = folder / f"{os.getpid()}.json"
        tmp = folder / f".{os.getpid()}.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(data)
            os.replace(tmp, target)
            _written[0] = data
        except OSError:
            pass


def totals(folder: Path) -> dict[str, int]:
    """The sums over every process that wrote to `folder`."""
    summed: dict[str, int] = {}
    for path in folder.glob("*.json"):
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for key, value in values.items():
            summed[key] = summed.get(key, 0) + int(value)
    return summed


_KIND = re.compile(r'\s*(?:(INSERT INTO|UPDATE|DELETE FROM)\s*"?(\w*)|(SELECT)(?:.*?\bFROM\b)?\s*"?(\w*)|(\w+))',
                   re.IGNORECASE | re.DOTALL)
_VERB_OR_PAREN = re.compile(r'[()]|\b(INSERT INTO|UPDATE|DELETE FROM|SELECT)\b\s*"?(\w*)', re.IGNORECASE)
_TABLED = {"SELECT", "INSERT INTO", "UPDATE", "DELETE FROM"}


def kind(sql: str) -> str:
    """A statement's verb and the first table it names: `SELECT tasks_task`, `SAVEPOINT`; a
    statement with a WITH clause by its main verb (`WITH INSERT INTO tasks_taskevent`), a compound
    one (`(SELECT …) UNION ALL (SELECT …)`) by its first part; a SELECT by the table of its own
    FROM, not a subquery's among its columns. Worked out once per distinct statement text."""
    found = _kinds.get(sql)
    if found is None:
        if len(_kinds) >= 4096:
            _kinds.clear()
        found = _kinds[sql] = _kind(sql)
    return found


_kinds: dict[str, str] = {}
_PAREN_OR_FROM = re.compile(r'[()]|\bFROM\s*"?(\w*)', re.IGNORECASE)


def _kind(sql: str) -> str:
    text = sql.lstrip(" \n(")
    found = _KIND.match(text[:400])
    if not found:
        return "other"
    verb = (found.group(1) or found.group(3) or found.group(5)).upper()
    table = found.group(2) or found.group(4) or ""
    if verb == "WITH":
        return _after_with(sql)
    if verb == "SELECT":
        depth = 0
        for token in _PAREN_OR_FROM.finditer(text):
            if token.group(0) in "()":
                depth += 1 if token.group(0) == "(" else -1
                if depth < 0:  # the end of a compound's first part
                    break
            elif depth == 0:
                table = token.group(1)
                break
    return f"{verb} {table}".strip() if verb in _TABLED else verb


def _after_with(sql: str) -> str:
    """A WITH statement by its main part, the first verb outside the parentheses of its parts
    (`WITH moved AS (UPDATE …), w0 AS (INSERT … SELECT …) INSERT INTO …`), and the table of that
    part's own FROM for a SELECT (`WITH SELECT moved`)."""
    depth, main = 0, None
    for token in _VERB_OR_PAREN.finditer(sql):
        if token.group(0) in "()":
            depth += 1 if token.group(0) == "(" else -1
        elif depth == 0:
            main = token
            break
    if main is None:
        return "WITH"
    verb, table = main.group(1).upper(), main.group(2)
    if verb == "SELECT":
        rest = _kind(sql[main.start():])
        table = rest.split(" ", 1)[1] if " " in rest else ""
    return f"WITH {verb} {table}".strip()


def _statement(execute: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
    count("statements")
    count(f"sql:{kind(sql)}")
    if os.environ.get("SLUICE_COUNT_WHERE"):
        count(f"at:{kind(sql)} @ {_where()}")
    return execute(sql, params, many, context)


def _where(depth: int = 4) -> str:
    """The innermost Sluice frames that executed a statement (SLUICE_COUNT_WHERE: where they go)."""
    import sys

    frame, found = sys._getframe(2), []
    while frame is not None and len(found) < depth:
        path = frame.f_code.co_filename
        if "/site-packages/" not in path and "/lib/python" not in path and not path.endswith("costs.py"):
            found.append(f"{Path(path).stem}.{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(found)


def install() -> None:
    """Count every statement of every database connection this process opens (when enabled)."""
    if directory() is None:
        return
    from django.db.backends.signals import connection_created

    def wrap(sender: Any, connection: Any, **kwargs: Any) -> None:
        if _statement not in connection.execute_wrappers:
            connection.execute_wrappers.append(_statement)

    connection_created.connect(wrap, weak=False, dispatch_uid="sluice-costs")
    # A timer flushes what a process counted before it went idle, started by its first count;
    # forked workers start their own (their parent's totals are not theirs), and a forked child
    # that counts nothing (the pre-check's sandbox) starts none.
    os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's flusher may have held it at the fork
    for key in _counts:
        _counts[key] = 0
    _written[0] = ""
    _flushing[0] = False


def _start_flusher() -> None:
    with _lock:
        if _flushing[0]:
            return
        _flushing[0] = True

    def keep_flushing() -> None:
        while True:
            time.sleep(FLUSH_S)
            flush()

    threading.Thread(target=keep_flushing, name="costs-flush", daemon=True).start()
