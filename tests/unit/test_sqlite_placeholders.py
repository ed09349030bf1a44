"""The SQLite backend converts a statement's placeholders as Django's does, once per text."""

from __future__ import annotations

import sqlite3

from django.db.backends.sqlite3.base import SQLiteCursorWrapper

from tasks.sqlite_backend.base import _Cursor, _qmark

STATEMENTS = [
    'SELECT "a" FROM "t" WHERE "b" = %s AND "c" IN (%s, %s) LIMIT %s',
    "SELECT '100%%' || %s, 'x' LIKE 'a%%b' FROM t",
    "INSERT INTO t (a, b) VALUES (%s, %s) RETURNING id",
    "SELECT 1",
]


def test_a_statement_is_converted_as_djangos_backend_converts_it():
    with sqlite3.connect(":memory:") as raw:
        ours, djangos = raw.cursor(factory=_Cursor), raw.cursor(factory=SQLiteCursorWrapper)
        for sql in STATEMENTS:
            assert ours.convert_query(sql) == djangos.convert_query(sql)
            names = ["a", "b"]
            named = "SELECT %(a)s, %(b)s"
            assert ours.convert_query(named, param_names=names) == djangos.convert_query(named, param_names=names)


def test_a_text_run_again_is_not_converted_again():
    sql = 'UPDATE "t" SET "a" = %s WHERE "id" = %s AND "note" <> \'%%\' -- test_a_text_run_again'
    with sqlite3.connect(":memory:") as raw:
        cursor = raw.cursor(factory=_Cursor)
        first = cursor.convert_query(sql)
        hits = _qmark.cache_info().hits
        again = cursor.convert_query(sql)
    assert again is first, "the converted text is the one made the first time"
    assert _qmark.cache_info().hits == hits + 1
