"""The multi-host harness: namespaced hosts on one machine, real links between them, partitions."""

from __future__ import annotations

import socket

import pytest

from tasks.hosts import Hosts, HostsUnavailable

pytestmark = pytest.mark.slow


@pytest.fixture
def hosts(tmp_path):
    try:
        built = Hosts(tmp_path / "hosts")
    except HostsUnavailable as exc:
        pytest.skip(f"the multi-host harness cannot run here: {exc}")
    with built:
        yield built


def _reach(host, address: str, port: int) -> bool:
    probe = f"import socket; socket.create_connection(('{address}', {port}), timeout=2)"
    return host.run("python3", "-c", probe, check=False).returncode == 0


def test_hosts_have_their_own_database_and_a_partition_cuts_only_its_links(hosts):
    url = hosts.start_database()
    db, a, b = hosts["db"], hosts["worker-a"], hosts["worker-b"]
    assert url.startswith(f"postgres://postgres@{db.address}:5432/")
    redis_at = hosts.redis_address
    assert _reach(a, db.address, 5432) and _reach(a, redis_at, 6379) and _reach(b, db.address, 5432)
    with socket.create_connection((redis_at, 6379), timeout=2) as redis:  # this process reaches every host
        redis.sendall(b"PING\r\n")
        assert redis.recv(16).startswith(b"+PONG")
    hosts.partition("worker-a", ["db", "redis"])
    assert not _reach(a, db.address, 5432) and not _reach(a, redis_at, 6379)
    assert _reach(b, db.address, 5432), "only worker-a's link to the db host is cut"
    hosts.heal("worker-a")
    assert _reach(a, db.address, 5432) and _reach(a, redis_at, 6379)
    hosts.partition("web", ["redis"])
    assert not _reach(hosts["web"], redis_at, 6379) and _reach(hosts["web"], db.address, 5432), "Redis alone"
    hosts.heal("web")
    assert _reach(hosts["web"], redis_at, 6379)


def test_killing_a_host_ends_every_process_on_it(hosts):
    hosts.start_database()
    db = hosts["db"]
    assert len(db.stack.processes) == 2
    assert db.kill_all() >= 2
    assert not _reach(hosts["web"], db.address, 5432)
    assert db.stack.processes == {}


def test_teardown_leaves_no_namespace_behind(tmp_path):
    import subprocess

    try:
        built = Hosts(tmp_path / "hosts", names=("db", "web"))
    except HostsUnavailable as exc:
        pytest.skip(f"the multi-host harness cannot run here: {exc}")
    names = [h.namespace for h in built.hosts.values()]
    built.teardown()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
