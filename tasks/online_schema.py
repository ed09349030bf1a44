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
