"""Inserts and reads cheaper than the ORM's, for the statements every submission and step runs.

A single INSERT is atomic by itself. Django's bulk_create opens a transaction around it all the
same (BEGIN and COMMIT: two more round trips, and on SQLite a statement more), which a log
written after every step (the vendor calls) paid each time. And the ORM builds every statement
through its query compiler, which on a submission's path cost more CPU than running the
statements (a submission's two reads and four INSERTs: about 2.5 of its 6 ms on SQLite). Here
the column lists are built once per model; the values are prepared, and the rows read back, by
the model's own fields, as the ORM prepares and converts them.
"""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import connections, router, transaction
from django.db.models import (
    AutoField,
    BigIntegerField,
    BooleanField,
    CharField,
    DateTimeField,
    F,
    Field,
    FloatField,
    ForeignKey,
    IntegerField,
    Model,
    PositiveIntegerField,
    PositiveSmallIntegerField,
    SlugField,
    SmallIntegerField,
    TextField,
    URLField,
    UUIDField,
    Value,
)
from django.db.models.base import ModelState
from django.db.models.expressions import CombinedExpression
from django.db.models.fields.reverse_related import ForeignObjectRel
from django.db.models.signals import post_init, pre_init
from django.utils import timezone
from django.utils.dateparse import parse_datetime

_COLUMNS: dict[tuple[type, str], tuple[list, str]] = {}
_PREPARERS: dict[tuple[type, str], list[Callable[[Model, Any], Any]]] = {}


_BLANKS: dict[type, tuple[dict[str, Any], list[tuple[str, Callable[[], Any]]]]] = {}


def new_row(model: type[Model], **values: Any) -> Model:
    """An unsaved instance, as `model(**values)` builds it: every field at its default (a callable
    default called for each instance), then `values` set through the model's attributes (a
    related object through its descriptor). Model.__init__ walks every field and its default for
    each instance: for the task's 58 fields, five times the cost of this, and on a batch request
    a fifth of its CPU. A model something listens to as it is built gets Model.__init__."""
    if pre_init.has_listeners(model) or post_init.has_listeners(model):
        return model(**values)
    blank = _BLANKS.get(model)
    if blank is None:
        fixed = {f.attname: f.get_default() for f in model._meta.concrete_fields
                 if not (f.has_default() and callable(f.default))}
        fresh = [(f.attname, f.default) for f in model._meta.concrete_fields if f.has_default() and callable(f.default)]
        blank = _BLANKS[model] = (fixed, fresh)
    obj = model.__new__(model)
    attributes = obj.__dict__
    attributes.update(blank[0])
    for attname, default in blank[1]:
        attributes[attname] = default()
    attributes["_state"] = ModelState()
    for name, value in values.items():
        setattr(obj, name, value)
    return obj


def insert_rows(objs: list[Model], *, return_pk: bool = False, using: str | None = None) -> Any:
    """Insert new rows of one model as bulk_create would (no signals, no save(); a primary key the
    database assigns is read back where the database can say it, as bulk_create reads it), in one
    statement when they fit in one (several in a transaction when they do not): inside the
    caller's transaction, or atomic by itself when there is none. `return_pk`: the one row's key
    is returned. Values that are expressions (F(), Now()) are left to bulk_create."""
    return prepared_insert(objs, return_pk=return_pk, using=using)()


def prepared_insert(objs: list[Model], *, return_pk: bool = False, using: str | None = None) -> Callable[[], Any]:
    """`insert_rows(objs)` with its values and statements made now and run when the answer is
    called (what insert_rows returns): a writer that must hold the database's one writer's lock
    for its statements builds them before it takes it. A primary key a row is given here (not one
    the database assigns) is the row's from now on."""
    if not objs:
        return lambda: None
    model = type(objs[0])
    alias = using or router.db_for_write(model)
    connection = connections[alias]
    fields, columns = _columns(model, alias, connection)
    pk_field = model._meta.pk
    assigned = fields is not None and pk_field not in fields  # the database assigns the key
    returning = assigned and connection.features.can_return_rows_from_bulk_insert
    if (fields is None or (return_pk and (len(objs) > 1 or not returning))
            or (assigned and any(obj.pk is not None for obj in objs))):
        return lambda: _orm_insert(model, objs, alias, return_pk)
    size = max(1, connection.ops.bulk_batch_size(fields, objs))
    rows = _values(objs, alias, connection, fields)
    if rows is None:
        return lambda: _orm_insert(model, objs, alias, return_pk)
    suffix = f" RETURNING {connection.ops.quote_name(pk_field.column)}" if returning else ""
    statements = [(objs[start:start + size], _insert_sql(model, alias, connection, rows[start:start + size], suffix))
                  for start in range(0, len(objs), size)]

    def run() -> Any:
        if len(statements) > 1 and not connection.in_atomic_block:
            with transaction.atomic(using=alias):
                return run()
        with transaction.mark_for_rollback_on_error(using=alias), connection.cursor() as cursor:
            for batch, statement in statements:
                cursor.execute(*statement)
                if returning:
                    for obj, (pk,) in zip(batch, cursor.fetchall(), strict=True):
                        obj.pk = pk
        for obj in objs:
            obj._state.adding, obj._state.db = False, alias
        return objs[0].pk if return_pk else None

    return run


def _values(objs: list[Model], alias: str, connection: Any, fields: list) -> list[list[Any]] | None:
    """Each row's values as its INSERT writes them (a key the database does not assign given to a
    row without one); None when one is an expression (left to the ORM)."""
    model = type(objs[0])
    pk_field = model._meta.pk
    assigned = pk_field not in fields
    rows: list[list[Any]] = []
    preparers = _preparers(model, alias, fields)
    for obj in objs:
        if not assigned and obj.pk is None:
            obj.pk = pk_field.get_pk_value_on_save(obj)
        obj._prepare_related_fields_for_save(operation_name="insert_rows")
        values = [prepare(obj, connection) for prepare in preparers]
        if any(hasattr(value, "resolve_expression") for value in values):
            return None
        rows.append(values)
    return rows


def _insert_sql(model: type[Model], alias: str, connection: Any, batch: list[list[Any]], suffix: str) -> tuple[str, list[Any]]:
    """The INSERT of `batch`'s rows of `model` (as `_values` prepared them) and its parameters."""
    fields, columns = _columns(model, alias, connection)
    unnest = _unnest(model, alias, fields, connection) if len(batch) > 1 else None
    if unnest is not None:
        # One array a column: a statement of the same text and as many parameters as columns
        # whatever the rows (see _unnest).
        return f"{columns} {unnest}{suffix}", [list(column) for column in zip(*batch, strict=True)]
    placeholders = "(" + ", ".join(["%s"] * len(fields)) + ")"
    return f"{columns} VALUES {', '.join([placeholders] * len(batch))}{suffix}", [value for values in batch for value in values]


def insert_together(first: list[Model], then: list[Model]) -> None:
    """`first`'s rows and `then`'s (of two models, each as insert_rows writes them), in one
    statement on PostgreSQL (a WITH: both or neither); elsewhere two, `first`'s first. One
    statement only when `first`'s keys are not the database's to assign and each fits in one."""
    if not first or not then:
        insert_rows(first or then)
        return
    alias = router.db_for_write(type(first[0]))
    connection = connections[alias]
    built = _together(first, then, alias, connection) if connection.vendor == "postgresql" else None
    if built is None:
        insert_rows(first, using=alias)
        insert_rows(then, using=alias)
        return
    (sql, params), read_keys = built
    with transaction.mark_for_rollback_on_error(using=alias), connection.cursor() as cursor:
        cursor.execute(sql, params)
        if read_keys:
            for obj, (pk,) in zip(then, cursor.fetchall(), strict=True):
                obj.pk = pk
    for obj in (*first, *then):
        obj._state.adding, obj._state.db = False, alias


def _together(first: list[Model], then: list[Model], alias: str, connection: Any) -> tuple[tuple[str, list[Any]], bool] | None:
    parts = []
    for objs in (first, then):
        model = type(objs[0])
        fields, _ = _columns(model, alias, connection)
        if fields is None or len(objs) > max(1, connection.ops.bulk_batch_size(fields, objs)):
            return None
        assigned = model._meta.pk not in fields
        if assigned and (objs is first or any(obj.pk is not None for obj in objs)):
            return None
        rows = _values(objs, alias, connection, fields)
        if rows is None:
            return None
        read_keys = assigned and connection.features.can_return_rows_from_bulk_insert
        suffix = f" RETURNING {connection.ops.quote_name(model._meta.pk.column)}" if read_keys else ""
        parts.append(_insert_sql(model, alias, connection, rows, suffix))
    (head, head_params), (main, main_params) = parts
    return (f"WITH written AS ({head}) {main}", [*head_params, *main_params]), read_keys


def _orm_insert(model: type[Model], objs: list[Model], alias: str, return_pk: bool) -> Any:
    """What insert_rows leaves to the ORM: bulk_create, or the one row's save() when its key is
    wanted and the database cannot return it from a bulk insert."""
    if return_pk and len(objs) == 1:
        objs[0].save(force_insert=True, using=alias)
        return objs[0].pk
    model._base_manager.using(alias).bulk_create(objs)
    return objs[0].pk if return_pk else None


def _preparers(model: type[Model], alias: str, fields: list) -> list[Callable[[Model, Any], Any]]:
    """For each field an INSERT writes, how an instance's value is prepared: what
    `field.get_db_prep_save(field.pre_save(obj, True), connection)` returns, with the values that
    chain hands on unchanged or to one adapter (a str for a text column, an int for an integer
    one, an aware datetime, a UUID, None) passed on without walking it."""
    key = (model, alias)
    if key not in _PREPARERS:
        _PREPARERS[key] = [_preparer(f) for f in fields]
    return _PREPARERS[key]


# (Subclasses that prepare their values as CharField does.)
_TEXT = (CharField, TextField, SlugField, URLField)
# (Not the automatic keys: theirs is another chain, validate_autopk_value instead of the adapter.)
_INTEGER = (IntegerField, BigIntegerField, SmallIntegerField, PositiveIntegerField, PositiveSmallIntegerField)


def _preparer(field: Field) -> Callable[[Model, Any], Any]:
    def full(obj: Model, connection: Any) -> Any:
        return field.get_db_prep_save(field.pre_save(obj, True), connection)

    # A timestamp set on save is set as its pre_save sets it, and then passed on as any datetime.
    stamped = type(field) is DateTimeField and (field.auto_now or field.auto_now_add)
    plain_read = type(field).pre_save is Field.pre_save or type(field) is DateTimeField
    column = field.target_field if type(field) is ForeignKey else field
    kind = type(column)
    if not plain_read or not (kind in _TEXT or kind in _INTEGER
                              or kind in (DateTimeField, UUIDField, BooleanField, FloatField)):
        return full
    attname = field.attname
    internal = column.get_internal_type()
    # One closure a kind of column, its type tests written out (this runs for every column of
    # every row an insert writes: the task's 58 are a third of a batch submission's CPU).
    if kind is DateTimeField:
        # The last value adapted and what it became: a batch's rows share their timestamps.
        last: list[Any] = [None, None]

        def prepare(obj: Model, connection: Any) -> Any:
            value = field.pre_save(obj, True) if stamped else getattr(obj, attname)
            if value is None:
                return None
            if type(value) is datetime and settings.USE_TZ and value.utcoffset() is not None:
                seen, adapted = last
                if seen is value or (seen == value and seen.tzinfo is value.tzinfo):
                    return adapted
                adapted = connection.ops.adapt_datetimefield_value(value)
                last[:] = value, adapted
                return adapted
            return field.get_db_prep_save(value, connection)
    elif kind in _TEXT:
        def prepare(obj: Model, connection: Any) -> Any:
            value = getattr(obj, attname)
            if value is None or isinstance(value, str):  # (a str subclass, a choice, is what to_python returns)
                return value
            return field.get_db_prep_save(value, connection)
    elif kind in _INTEGER or kind is UUIDField:
        if kind is UUIDField:
            plain: type = uuid.UUID

            def adapt(value: Any, connection: Any) -> Any:
                return value if connection.features.has_native_uuid_field else value.hex
        else:
            plain = int

            def adapt(value: Any, connection: Any) -> Any:
                return connection.ops.adapt_integerfield_value(value, internal)

        def prepare(obj: Model, connection: Any) -> Any:
            value = getattr(obj, attname)
            if value is None:
                return None
            if type(value) is plain:
                return adapt(value, connection)
            return field.get_db_prep_save(value, connection)
    else:  # BooleanField, FloatField
        plain = bool if kind is BooleanField else float  # (passed on as they are)

        def prepare(obj: Model, connection: Any) -> Any:
            value = getattr(obj, attname)
            if value is None or type(value) is plain:
                return value
            return field.get_db_prep_save(value, connection)

    prepare.stamped = stamped  # type: ignore[attr-defined]
    return prepare


_UNNESTS: dict[tuple[type, str], str | None] = {}


def _unnest(model: type[Model], alias: str, fields: list, connection: Any) -> str | None:
    """PostgreSQL: the rows of a multi-row INSERT as `SELECT * FROM UNNEST(%s::type[], ...)`, one
    array a column, as Django's own bulk_create writes them since 5.2 (for the fields it writes
    them for); None elsewhere. The VALUES list it replaces had a placeholder a value (5,800 for a
    hundred tasks): psycopg splits a statement that long at every execution (caching only short
    ones), and PostgreSQL planned each row count as a statement of its own."""
    key = (model, alias)
    if key not in _UNNESTS:
        usable = connection.vendor == "postgresql" and not any(
            hasattr(f, "get_placeholder")
            or (f.target_field if f.is_relation else f).get_internal_type() not in connection.data_types
            for f in fields)
        # Without the types' parameters: varchar[], not varchar(64)[] (which would truncate).
        types = [f.db_type(connection).split("(")[0] for f in fields]
        _UNNESTS[key] = f"SELECT * FROM UNNEST({', '.join(f'(%s)::{t}[]' for t in types)})" if usable else None
    return _UNNESTS[key]


def _columns(model: type[Model], alias: str, connection: Any) -> tuple[list | None, str]:
    """The fields an INSERT of `model` writes and its `INSERT INTO … (columns)`; None for a model
    with what bulk_create prepares and this does not (database defaults, generated columns)."""
    key = (model, alias)
    if key not in _COLUMNS:
        fields = [f for f in model._meta.concrete_fields
                  if not (f.primary_key and isinstance(f, AutoField))]
        if any(f.generated or f.has_db_default() for f in fields):
            _COLUMNS[key] = (None, "")
        else:
            quote = connection.ops.quote_name
            _COLUMNS[key] = (fields, f"INSERT INTO {quote(model._meta.db_table)} "
                                     f"({', '.join(quote(f.column) for f in fields)})")
    return _COLUMNS[key]


def select(model: type[Model], where: str, params: list[tuple[str | None, Any]], *,
           only: tuple[str, ...] | None = None, related: tuple[str, ...] = (),
           extra: dict[str, str] | None = None, join: str = "",
           over: tuple[str, tuple[str, list[Any]]] | None = None) -> list[Model]:
    """The rows of `model` matching `where`, as model instances read as the ORM reads them (its
    converters: UUIDs, dates, JSON), with the statement's columns and joins built once per shape
    instead of compiling a queryset per call.

    `where`: SQL over the model's table, aliased `t` (and anything after the condition, such as
    ORDER BY), `%s` for each parameter; each parameter is given with the name of the field it is
    compared with and prepared as the ORM prepares it for that field (None: as it is).
    `only`: the fields read (the others deferred, the primary key always read). `related`:
    foreign keys (or the reverse side of one-to-one keys) whose rows are read in the same
    statement, as select_related reads them (a LEFT JOIN each, aliased `r_<name>`; a missing one
    is None). `extra`: more columns, SQL expressions
    (over `t` and the joined aliases), each set on the instances under its name, as read.
    `join`: more tables (SQL after the statement's own, such as a LEFT JOIN of a table that is
    not a relation, without placeholders), read through `extra`. `over`: (a name, a built
    statement that returns the model's rows, such as an UPDATE … RETURNING t.*): the rows are
    read from what that statement returns, in the same statement (a WITH; PostgreSQL), instead
    of from the model's table."""
    alias = router.db_for_read(model)
    connection = connections[alias]
    shape = _select(model, alias, only, related, connection)
    prepared = [value if name is None else _field(model, name).get_db_prep_value(value, connection)
                for name, value in params]
    columns = shape.columns
    extra = extra or {}
    if extra:
        columns += ", " + ", ".join(f"({sql}) AS {connection.ops.quote_name(name)}" for name, sql in extra.items())
    tables, head = shape.tables, ""
    if over is not None:
        name, (sql, values) = over
        tables = f"{name} t{tables[len(connection.ops.quote_name(model._meta.db_table)) + 2:]}"
        head, prepared = f"WITH {name} AS ({sql}) ", [*values, *prepared]
    # (A read that writes through `over` marks a caller's transaction for rollback when it fails.)
    guard = transaction.mark_for_rollback_on_error(using=alias) if over is not None else contextlib.nullcontext()
    with guard, connection.cursor() as cursor:
        cursor.execute(f"{head}SELECT {columns} FROM {tables} {join} WHERE {where}", prepared)
        found = cursor.fetchall()
    return _assembled(shape, found, list(extra), alias, connection)


def update_read(model: type[Model], changes: dict[str, Any], where: str, params: list[tuple[str | None, Any]], *,
                related: tuple[str, ...] = (), extra: dict[str, str] | None = None) -> list[Model]:
    """The rows `UPDATE … SET changes WHERE where` changed, read as `select` reads them (with
    `related` and `extra`), from the UPDATE's own RETURNING: one statement. For SQLite, whose
    RETURNING cannot join (PostgreSQL reads an UPDATE's rows with `select(over=…)`): each column
    of a related row is a subquery by its key, each of `extra` a subquery over the row and its
    joins. Changes `update_sql` leaves to the ORM are refused (ValueError)."""
    alias = router.db_for_write(model)
    connection = connections[alias]
    quote = connection.ops.quote_name
    shape = _select(model, alias, None, related, connection)
    table, pk = quote(model._meta.db_table), quote(model._meta.pk.column)
    read = [f"{table}.{quote(f.column)}" for f in model._meta.concrete_fields]
    for name in related:
        via = model._meta.get_field(name)
        target = via.related_model
        if isinstance(via, ForeignObjectRel):
            match = f"r.{quote(via.field.column)} = {table}.{quote(via.field.target_field.column)}"
        else:
            match = f"r.{quote(via.target_field.column)} = {table}.{quote(via.column)}"
        read += [f"(SELECT r.{quote(f.column)} FROM {quote(target._meta.db_table)} r WHERE {match})"
                 for f in target._meta.concrete_fields]
    extra = extra or {}
    read += [f"(SELECT ({sql}) FROM {shape.tables} WHERE t.{pk} = {table}.{pk})" for sql in extra.values()]
    built = update_sql(model, changes, where, params, returning=", ".join(read))
    if built is None:
        raise ValueError(f"rows.update_read cannot build this change of {model.__name__} ({', '.join(changes)})")
    with transaction.mark_for_rollback_on_error(using=alias), connection.cursor() as cursor:
        cursor.execute(*built)
        found = cursor.fetchall()
    return _assembled(shape, found, list(extra), alias, connection)


def _assembled(shape: _Shape, found: list, extra: list[str], alias: str, connection: Any) -> list[Model]:
    """Model instances (with their related rows and `extra` values) from rows of `shape`'s columns."""
    rows = []
    for values in found:
        values = list(values)
        for index, chain in shape.converters:
            for convert, expression in chain:
                values[index] = convert(values[index], expression, connection)
        row = None
        for part in shape.parts:
            piece = values[part.start:part.start + len(part.names)]
            if part.via is None:
                row = part.model.from_db(alias, part.names, piece)
            else:
                joined = None if piece[part.key] is None else part.model.from_db(alias, part.names, piece)
                part.via.set_cached_value(row, joined)
                if joined is not None and isinstance(part.via, ForeignObjectRel):
                    part.via.field.set_cached_value(joined, row)  # health.channel, as select_related sets it
        for name, value in zip(extra, values[shape.width:], strict=True):
            setattr(row, name, value)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class _Part:
    model: type[Model]
    names: list[str]  # attnames, in the model's order (what from_db expects)
    start: int  # its first column in the row
    via: Any = None  # the foreign key it is joined by (None: the model read)
    key: int = 0  # where its primary key is among them (None there: no joined row)


@dataclass(frozen=True)
class _Shape:
    columns: str
    tables: str
    parts: list[_Part]
    converters: list
    width: int


_SELECTS: dict[tuple, _Shape] = {}
_FIELDS: dict[tuple[type, str], Any] = {}


def json_rows_sql(vendor: str, columns: str) -> str:
    """An aggregate of a subquery's rows as one JSON array of arrays (each row's `columns`, SQL),
    so that a statement can read another table's rows as one column of its own; read back with
    `json_rows`. SQLite's json_group_array gives '[]' for no rows, PostgreSQL's json_agg NULL."""
    if vendor == "postgresql":
        return f"json_agg(json_build_array({columns}))"
    return f"json_group_array(json_array({columns}))"


def json_rows(value: Any) -> list[list[Any]]:
    """The rows of a `json_rows_sql` column as read (text on SQLite, parsed by psycopg, or None),
    or rows given as a list already."""
    if isinstance(value, str):
        return json.loads(value)
    return value or []


def moment(value: Any) -> datetime | None:
    """A timestamp read by hand (a raw column, or a JSON value): SQLite gives its text (UTC),
    PostgreSQL an aware datetime or, inside JSON, ISO text with its offset."""
    found = parse_datetime(value) if isinstance(value, str) else value
    return timezone.make_aware(found, UTC) if found is not None and timezone.is_naive(found) else found


def _field(model: type[Model], name: str) -> Any:
    if (model, name) not in _FIELDS:
        _FIELDS[(model, name)] = model._meta.get_field(name)
    return _FIELDS[(model, name)]


def _select(model: type[Model], alias: str, only: tuple[str, ...] | None, related: tuple[str, ...],
            connection: Any) -> _Shape:
    key = (model, alias, only, related)
    if key not in _SELECTS:
        quote = connection.ops.quote_name
        fields = [f for f in model._meta.concrete_fields if only is None or f.primary_key or f.name in only or f.attname in only]
        segments = [("t", model, fields, None)]
        tables = f"{quote(model._meta.db_table)} t"
        for name in related:
            via = model._meta.get_field(name)
            target = via.related_model
            table_alias = f"r_{name}"
            if isinstance(via, ForeignObjectRel):  # the reverse side of a one-to-one (its row's key is ours)
                join = f"{table_alias}.{quote(via.field.column)} = t.{quote(via.field.target_field.column)}"
            else:
                join = f"{table_alias}.{quote(via.target_field.column)} = t.{quote(via.column)}"
            tables += f" LEFT JOIN {quote(target._meta.db_table)} {table_alias} ON {join}"
            segments.append((table_alias, target, list(target._meta.concrete_fields), via))
        columns, parts, converters, start = [], [], [], 0
        for table_alias, part_model, part_fields, via in segments:
            parts.append(_Part(model=part_model, names=[f.attname for f in part_fields], start=start, via=via,
                               key=next(i for i, f in enumerate(part_fields) if f.primary_key)))
            for f in part_fields:
                column = f.get_col(table_alias)
                chain = [(c, column) for c in connection.ops.get_db_converters(column) + column.get_db_converters(connection)]
                if chain:
                    converters.append((start, chain))
                columns.append(f"{table_alias}.{quote(f.column)}")
                start += 1
        _SELECTS[key] = _Shape(columns=", ".join(columns), tables=tables, parts=parts, converters=converters, width=start)
    return _SELECTS[key]


def update_sql(model: type[Model], changes: dict[str, Any], where: str, params: list[tuple[str | None, Any]],
               *, returning: str = "") -> tuple[str, list[Any]] | None:
    """The statement `UPDATE <model's table> AS t SET … WHERE <where>` and its parameters, built
    without the ORM's compiler, or None for what it leaves to the ORM: an expression other than
    `F(number field) ± a number`, a model instance for a field that is not its foreign key, a
    field with a placeholder of its own. Values are prepared as QuerySet.update prepares them
    (a model instance for a foreign key by its key; no auto_now, as update() sets none); `where`
    and `params` as for `select`."""
    if not changes:
        raise ValueError("an UPDATE needs something to change")
    connection = connections[router.db_for_write(model)]
    quote = connection.ops.quote_name
    sets, values = [], []
    for name, value in changes.items():
        field = _field(model, name)
        if hasattr(field, "get_placeholder"):
            return None
        column = quote(field.column)
        if isinstance(value, CombinedExpression):
            step = _number_step(model, field, value)
            if step is None:
                return None
            sets.append(f"{column} = {quote(step[0].column)} {value.connector} %s")
            values.append(step[1])
            continue
        if hasattr(value, "resolve_expression"):
            return None
        if isinstance(value, Model):
            if not field.remote_field:
                return None
            value = value.prepare_database_save(field)
        sets.append(f"{column} = %s")
        values.append(field.get_db_prep_save(value, connection))
    values += [value if name is None else _field(model, name).get_db_prep_value(value, connection)
               for name, value in params]
    sql = f"UPDATE {quote(model._meta.db_table)} AS t SET {', '.join(sets)} WHERE {where}"
    return (f"{sql} RETURNING {returning}" if returning else sql), values


_NUMBERS = (IntegerField, FloatField)  # BigIntegerField, PositiveIntegerField… are IntegerFields


def _number_step(model: type[Model], field: Any, value: CombinedExpression) -> tuple[Any, int | float] | None:
    """`F(name) ± n` on number fields as (the field read, n); None for any other expression."""
    if not (isinstance(value.lhs, F) and isinstance(value.rhs, Value) and value.connector in ("+", "-")):
        return None
    step = value.rhs.value
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return None
    read = model._meta.pk if value.lhs.name == "pk" else _field(model, value.lhs.name)
    return (read, step) if isinstance(field, _NUMBERS) and isinstance(read, _NUMBERS) else None


def update(model: type[Model], changes: dict[str, Any], where: str, params: list[tuple[str | None, Any]]) -> int:
    """Run `update_sql`'s statement: the rows it changed. For changes it leaves to the ORM this
    raises (a caller with a queryset for them uses `update_sql` and the ORM itself)."""
    built = update_sql(model, changes, where, params)
    if built is None:
        raise ValueError(f"rows.update cannot build this change of {model.__name__} ({', '.join(changes)})")
    alias = router.db_for_write(model)
    with transaction.mark_for_rollback_on_error(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(*built)
        return cursor.rowcount


# The values a note carries as they are (JSON's own types, a choice's value among them; SQLite's
# json_extract gives them back as the INSERT's parameters would be written). Any other value
# (bytes, a number JSON cannot write) is written by a statement.
def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int)) or (isinstance(value, float) and math.isfinite(value))


@dataclass(frozen=True)
class Write:
    """A write that commits with a task's move (`lifecycle.transition(writes=…)` and its kin):
    `rows` inserted, or `changes` made to the rows of `model` that `match` (field → value, None
    for NULL, a list for any of its values; as `matching` takes them); only if the task moved
    (`if_moved`), or whatever came of the move. On PostgreSQL it is part of the move's own
    statement (a data-modifying WITH over the moved row, `moved`); on SQLite it is carried in the
    move's note and written by the trigger as the row is (`noted`), or, a write the trigger cannot
    make, runs after the move in its transaction. Either way it commits exactly with the move."""

    model: type[Model]
    rows: tuple[Model, ...] = ()
    changes: dict[str, Any] | None = None
    match: tuple[tuple[str, Any], ...] = ()
    if_moved: bool = True

    @classmethod
    def insert(cls, objs: list[Model], *, if_moved: bool = True) -> Write:
        return cls(type(objs[0]), rows=tuple(objs), if_moved=if_moved)

    @classmethod
    def change(cls, model: type[Model], changes: dict[str, Any], match: dict[str, Any], *, if_moved: bool = True) -> Write:
        return cls(model, changes=changes, match=tuple(match.items()), if_moved=if_moved)

    def where(self) -> tuple[str, list[tuple[str | None, Any]]]:
        """The change's condition as `update` takes it."""
        built = matching(self.model, dict(self.match))
        if built is None:
            raise ValueError(f"a write's match must be fields' values ({self.model.__name__})")
        return built

    def run(self) -> int:
        """The write as a statement of its own (SQLite: after the move, in its transaction): the
        rows it changed (inserted rows: 0)."""
        if self.rows:
            insert_rows(list(self.rows))
            return 0
        return update(self.model, dict(self.changes or {}), *self.where())

    def noted(self, alias: str) -> tuple[str, Any] | None:
        """The write as a move's note carries it to SQLite's trigger (`lifecycle`): ("i", each
        row as {column: value as its INSERT writes it}) or ("u", {"s": {column: value}, "m":
        {column: value, None or a list}}); None for what only a statement of its own can write
        (an expression among the values)."""
        connection = connections[alias]
        if self.rows:
            fields, _ = _columns(self.model, alias, connection)
            values = None if fields is None else _values(list(self.rows), alias, connection, fields)
            if values is None:
                return None
            for obj in self.rows:
                obj._state.adding, obj._state.db = False, alias
            if not all(_plain(value) for row in values for value in row):
                return None
            columns = [f.column for f in fields]
            return "i", [dict(zip(columns, row, strict=True)) for row in values]
        sets: dict[str, Any] = {}
        for name, value in (self.changes or {}).items():
            field = _field(self.model, name)
            if hasattr(value, "resolve_expression") or hasattr(field, "get_placeholder"):
                return None
            if isinstance(value, Model):
                value = value.prepare_database_save(field)
            sets[field.column] = field.get_db_prep_save(value, connection)
        matched: dict[str, Any] = {}
        for name, value in self.match:
            field = _field(self.model, name)
            if isinstance(value, Model):
                value = value.prepare_database_save(field)
            if isinstance(value, (list, tuple)):
                matched[field.column] = [field.get_db_prep_value(v, connection) for v in value]
            else:
                matched[field.column] = None if value is None else field.get_db_prep_value(value, connection)
        plain = [*sets.values(), *(v for value in matched.values() for v in (value if isinstance(value, list) else [value]))]
        return ("u", {"s": sets, "m": matched}) if all(_plain(value) for value in plain) else None

    def over_moved(self) -> tuple[str, list[Any]]:
        """The write as a statement of a data-modifying WITH beside `moved` (PostgreSQL): with
        `if_moved`, it writes nothing when `moved` has no row."""
        moved = "EXISTS (SELECT 1 FROM moved)"
        if not self.rows:
            where, params = self.where()
            where = f"({where}) AND {moved}" if self.if_moved else where
            built = update_sql(self.model, dict(self.changes or {}), where, params)
            if built is None:
                raise ValueError(f"a write with a move cannot change {self.model.__name__} ({', '.join(self.changes or {})})")
            return built
        alias = router.db_for_write(self.model)
        connection = connections[alias]
        fields, columns = _columns(self.model, alias, connection)
        if fields is None:
            raise ValueError(f"a write with a move cannot insert {self.model.__name__}")
        rows = _values(list(self.rows), alias, connection, fields)
        if rows is None:
            raise ValueError(f"a write with a move cannot insert expressions ({self.model.__name__})")
        values = [value for row in rows for value in row]
        names = ", ".join(f"c{n}" for n in range(len(fields)))
        # Without the types' parameters: a cast to varchar(64) would cut a longer value short
        # where the INSERT itself refuses it (as _unnest's arrays).
        casts = "(" + ", ".join(f"%s::{field.db_type(connection).split('(')[0]}" for field in fields) + ")"
        condition = f" WHERE {moved}" if self.if_moved else ""
        return (f"{columns} SELECT {names} FROM (VALUES {', '.join([casts] * len(self.rows))}) AS v ({names})"
                f"{condition}"), values


def insert_fields(model: type[Model], alias: str) -> list:
    """The fields an INSERT of `model` writes, in its order (what `Write.noted` writes a row as)."""
    fields, _ = _columns(model, alias, connections[alias])
    if fields is None:
        raise ValueError(f"{model.__name__} has columns an INSERT built here does not write")
    return fields


def matching(model: type[Model], conditions: dict[str, Any]) -> tuple[str, list[tuple[str | None, Any]]] | None:
    """`t.<column> = %s AND …` for field values (`IS NULL` for None, `IN (…)` for a list), with their parameters;
    None when a condition is a lookup (`name__isnull`) or an expression (left to the ORM)."""
    quote = connections[router.db_for_read(model)].ops.quote_name
    parts, params = [], []
    for name, value in conditions.items():
        if "__" in name or hasattr(value, "resolve_expression"):
            return None
        field = _field(model, name)
        column = f"t.{quote(field.column)}"
        if value is None:
            parts.append(f"{column} IS NULL")
            continue
        if isinstance(value, (list, tuple)):  # any of these values
            parts.append(f"{column} IN ({', '.join(['%s'] * len(value))})")
            params += [(name, item) for item in value]
            continue
        if isinstance(value, Model):
            if not field.remote_field:
                return None
            value = value.prepare_database_save(field)
        parts.append(f"{column} = %s")
        params.append((name, value))
    return " AND ".join(parts), params


@contextlib.contextmanager
def planned_for_its_values(model: type[Model]):
    """PostgreSQL: the statements run inside (on `model`'s database) are planned for their own
    values each time, never by the plan a prepared statement keeps on its connection. For a
    statement whose best plan depends on how many values it is given and how large the table has
    grown: PostgreSQL keeps a prepared statement's generic plan once it has made one, until the
    table's statistics change, and one made while the table was small (a fresh installation's
    first minute, before autovacuum has analyzed it) can read a whole range of the table for
    each value. Planning costs a fraction of a millisecond of the database's CPU."""
    connection = connections[router.db_for_read(model)]
    if connection.vendor != "postgresql":
        yield
        return
    connection.ensure_connection()
    raw = connection.connection
    kept = raw.prepare_threshold
    raw.prepare_threshold = None
    try:
        yield
    finally:
        raw.prepare_threshold = kept
