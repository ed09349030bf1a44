"""Schema changes that keep the system writing while they run on PostgreSQL: an index on a busy
table (tasks, budget slots, files) is built CONCURRENTLY there, so task moves, admissions and
uploads are not blocked for the length of the build; SQLite (one writer, small installations)
builds it plainly. A migration using these sets `atomic = False` (PostgreSQL cannot build an
index concurrently inside a transaction)."""

from __future__ import annotations

from django.db import migrations


def _online(schema_editor) -> bool:
    return schema_editor.connection.vendor == "postgresql"


class AddIndexOnline(migrations.AddIndex):
    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if not _online(schema_editor):
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.add_index(model, self.index, concurrently=True)
        return None

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if not _online(schema_editor):
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.remove_index(model, self.index, concurrently=True)
        return None


class RemoveIndexOnline(migrations.RemoveIndex):
    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if not _online(schema_editor):
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            index = from_state.models[app_label, self.model_name_lower].get_index_by_name(self.name)
            schema_editor.remove_index(model, index, concurrently=True)
        return None

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if not _online(schema_editor):
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            index = to_state.models[app_label, self.model_name_lower].get_index_by_name(self.name)
            schema_editor.add_index(model, index, concurrently=True)
        return None


class DropFieldIndex(migrations.AlterField):
    """A field that had its own index (a foreign key's, `db_index=True`) no longer has one: only
    that index is dropped, CONCURRENTLY on PostgreSQL. (Django's AlterField would rebuild the
    whole table on SQLite, and with it drop the triggers that keep the task counters.) Any other
    change to the field would be lost in the database, so it is refused."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            _only_the_index_changes(model._meta.get_field(self.name),
                                    to_state.apps.get_model(app_label, self.model_name)._meta.get_field(self.name))
            concurrently = " CONCURRENTLY" if _online(schema_editor) else ""
            # PostgreSQL also gave a text key's field a second index, for LIKE: both go.
            for suffix in ("", "_like") if _online(schema_editor) else ("",):
                name = _field_index_name(schema_editor, model, self.name, suffix)
                schema_editor.execute(f"DROP INDEX{concurrently} IF EXISTS {schema_editor.quote_name(name)}")

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            field = model._meta.get_field(self.name)
            concurrently = " CONCURRENTLY" if _online(schema_editor) else ""
            name = _field_index_name(schema_editor, model, self.name, "")
            schema_editor.execute(f"CREATE INDEX{concurrently} IF NOT EXISTS {schema_editor.quote_name(name)} ON "
                                  f"{schema_editor.quote_name(model._meta.db_table)} ({schema_editor.quote_name(field.column)})")
            like = schema_editor._create_like_index_sql(model, field) if _online(schema_editor) else None
            if like is not None:
                schema_editor.execute(str(like).replace("CREATE INDEX ", "CREATE INDEX CONCURRENTLY IF NOT EXISTS ", 1))


def _field_index_name(schema_editor, model, field_name: str, suffix: str) -> str:
    """The name Django gave a field's own index (as `_create_index_sql` and, for LIKE on
    PostgreSQL, `_create_like_index_sql` name them)."""
    column = model._meta.get_field(field_name).column
    return schema_editor._create_index_name(model._meta.db_table, [column], suffix=suffix)


def _only_the_index_changes(old, new) -> None:
    def described(field) -> tuple:
        _, path, args, kwargs = field.deconstruct()
        kwargs.pop("db_index", None)
        return path, args, kwargs

    if described(old) != described(new) or not old.db_index or new.db_index:
        raise ValueError(f"DropFieldIndex only takes {old.name}'s own index away; use AlterField for other changes")
