"""The benchmark measures Sluice as it ships: its processes keep the shipped log level unless the
person running it asks for another (SLUICE_BENCH_LOG_LEVEL)."""

from __future__ import annotations

from tasks.bench.suite import Bench


def test_the_benchmarks_processes_log_at_the_level_sluice_ships_with(tmp_path, monkeypatch):
    monkeypatch.delenv("SLUICE_LOG_LEVEL", raising=False)
    monkeypatch.delenv("SLUICE_BENCH_LOG_LEVEL", raising=False)
    env = Bench(tmp_path, quick=True, log=lambda line: None).stack._env()
    assert "SLUICE_LOG_LEVEL" not in env  # so console/settings.py's default (INFO) holds


def test_another_level_is_the_runners_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_BENCH_LOG_LEVEL", "WARNING")
    env = Bench(tmp_path, quick=True, log=lambda line: None).stack._env()
    assert env["SLUICE_LOG_LEVEL"] == "WARNING"
