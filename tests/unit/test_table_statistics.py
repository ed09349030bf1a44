"""When the dispatcher analyzes a PostgreSQL table: once it has outgrown its statistics, never
for a table of a few rows, and never before autovacuum would for a large one."""

from tasks.table_statistics import LEAST_ROWS, TableGrowth


def growth(described, live, changed) -> TableGrowth:
    return TableGrowth(name="tasks_task", described_rows=described, live_rows=live, changed_rows=changed)


def test_a_table_never_analyzed_is_analyzed_once_it_holds_enough_rows_to_plan_by():
    assert not growth(None, LEAST_ROWS - 1, LEAST_ROWS - 1).needs_statistics()
    assert growth(None, LEAST_ROWS, LEAST_ROWS).needs_statistics()


def test_a_table_is_analyzed_again_once_as_many_rows_changed_as_it_held():
    assert not growth(5000.0, 9000, 4000).needs_statistics()
    assert growth(5000.0, 10000, 5000).needs_statistics()
    # Rewritten in place (every task moved on): its values changed, not its size.
    assert growth(5000.0, 5000, 5000).needs_statistics()


def test_a_table_analyzed_while_empty_is_analyzed_when_it_has_grown():
    assert not growth(0.0, 999, 999).needs_statistics()
    assert growth(0.0, 1000, 1000).needs_statistics()


def test_a_small_table_written_often_is_left_to_autovacuum():
    # A counter row rewritten by every submission: thousands of changes, two rows.
    assert not growth(2.0, 2, 100_000).needs_statistics()


def test_a_large_table_is_left_to_autovacuum_which_comes_first():
    # Autovacuum analyzes after a tenth (and 50 rows) changed; this rule only after all of it.
    assert not growth(1_000_000.0, 1_050_000, 150_000).needs_statistics()
