"""Writes that need no transaction of their own.

A single INSERT is atomic by itself. Django's bulk_create opens a transaction around it all the
same (BEGIN and COMMIT: two more round trips, and on SQLite a statement more), which a log
written after every step (the vendor calls) pays each time.
"""

from __future__ import annotations

from django.db import connections, router
from django.db.models import AutoField, BigAutoField, Model


def insert_rows(objs: list[Model]) -> None:
    """Insert new rows of one model whose primary key the database assigns: in one statement
    without a transaction when they fit in one (and none is open), else with bulk_create."""
    if not objs:
        return
    model = type(objs[0])
    alias = router.db_for_write(model)
    connection = connections[alias]
    fields = [f for f in model._meta.concrete_fields if not (f.primary_key and isinstance(f, (AutoField, BigAutoField)))]
    # What bulk_create prepares and this does not (database defaults, generated columns) is left to it.
    special = any(f.generated or f.has_db_default() for f in fields)
    if (special or connection.in_atomic_block or len(fields) == len(model._meta.concrete_fields)
            or len(objs) > connection.ops.bulk_batch_size(fields, objs)):
        model._base_manager.using(alias).bulk_create(objs)
        return
    for obj in objs:
        obj._prepare_related_fields_for_save(operation_name="insert_rows")
    # The one statement bulk_create would send for this batch (its transaction left out).
    model._base_manager.using(alias)._insert(objs, fields=fields, using=alias)
    for obj in objs:
        obj._state.adding, obj._state.db = False, alias
