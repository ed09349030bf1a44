"""Several hosts on one machine, for tests that need real networks between Sluice's processes.

Each host is a network namespace with one interface (a veth pair whose other end is on a bridge
in the root namespace, where this process sits at 10.77.<n>.1): `db` (its own PostgreSQL cluster
and Redis), `web`, `worker-a` and `worker-b` (dispatcher and lane clusters), `vendor` (the fake
vendor) and `store` (an S3 protocol server). A partition is a pair of blackhole routes between
the two hosts: a new connection fails at once, an established one loses every packet (its peer
hears nothing until its own timeouts fire), and healing removes the routes.

Needs root and iproute2 (Debian's). Where namespaces cannot be created, `Hosts()` raises
HostsUnavailable with the reason instead of pretending. Everything it made is torn down on exit,
pass or fail (and by `Hosts.sweep()` after a crash: every name carries the `sl` prefix).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tasks.system import Stack

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), None) if Path("/usr/lib/postgresql").exists() else None
HOST_NAMES = ("db", "web", "worker-a", "worker-b", "vendor", "store")


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, or a sandbox forbids it)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    stack: Stack
    blackholes: set[str] = field(default_factory=set)

    def run(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(["ip", "netns", "exec", self.namespace, *command], capture_output=True, text=True,
                              **kwargs)
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(command)}: {done.stderr.strip()[-500:]}")
        return done

    def kill_all(self, sig: int = signal.SIGKILL) -> int:
        """Every process of this host, at once (a host that loses power)."""
        pids = _ip("netns", "pids", self.namespace, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except (ProcessLookupError, ValueError):
                pass
        for name in list(self.stack.processes):
            managed = self.stack.processes.pop(name)
            managed.process.wait(timeout=10)
            managed.log.close()
        return len(pids)


class Hosts:
    """The namespaced hosts; a context manager that tears them all down."""

    def __init__(self, run_dir: Path, names: tuple[str, ...] = HOST_NAMES, *, attach: dict | None = None) -> None:
        self.owner = attach is None
        if attach is not None:
            # Hosts another process built (it tears them down): this one starts processes on them.
            self.run_dir, self.tag, self.subnet = Path(attach["run_dir"]), attach["tag"], attach["subnet"]
            self.bridge, self.admin_token, self.scratch = attach["bridge"], attach["admin_token"], []
            self.redis_address = attach["redis_address"]
            self.hosts = {}
            for name, (namespace, address) in attach["hosts"].items():
                self.hosts[name] = Host(name=name, namespace=namespace, address=address, stack=self._stack(name, namespace, address))
            return
        self.check()
        self.run_dir = run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.77.{int(self.tag, 16) % 200 + 20}"
        self.bridge = f"slbr{self.tag}"
        self.hosts: dict[str, Host] = {}
        self.admin_token = secrets.token_urlsafe(16)
        self.scratch: list[Path] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index, name in enumerate(names, start=2):
                self._add(name, index)
        except BaseException:
            self.teardown()
            raise

    @staticmethod
    def check() -> None:
        if os.geteuid() != 0:
            raise HostsUnavailable("the multi-host harness needs root (network namespaces and veth pairs)")
        if shutil.which("ip") is None:
            raise HostsUnavailable("the multi-host harness needs iproute2's `ip` (apt-get install iproute2)")
        probe = f"slprobe{os.getpid()}"
        done = _ip("netns", "add", probe, check=False)
        if done.returncode != 0:
            raise HostsUnavailable(f"network namespaces cannot be created here: {done.stderr.strip()}")
        _ip("netns", "del", probe, check=False)

    def _add(self, name: str, index: int) -> None:
        namespace = f"sl{self.tag}-{name}"
        outside = f"sl{self.tag}v{index}"
        _ip("netns", "add", namespace)
        _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        address = f"{self.subnet}.{index}"
        for command in (("addr", "add", f"{address}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                        ("link", "set", "lo", "up")):
            _ip("-n", namespace, *command)
        self.hosts[name] = Host(name=name, namespace=namespace, address=address,
                                stack=self._stack(name, namespace, address))
        if name == "db":
            # Redis has an address of its own on the db host, so it can be cut off alone.
            self.redis_address = f"{self.subnet}.{100 + index}"
            _ip("-n", namespace, "addr", "add", f"{self.redis_address}/24", "dev", "eth0")

    def _stack(self, name: str, namespace: str, address: str) -> Stack:
        return Stack(log_dir=self.run_dir / name, wrap=["ip", "netns", "exec", namespace], bind=address,
                     env={"FAKEVENDOR_ADMIN_TOKEN": self.admin_token})

    def describe(self) -> dict:
        """What another process needs to start processes on these hosts (Hosts(attach=...))."""
        return {"run_dir": str(self.run_dir), "tag": self.tag, "subnet": self.subnet, "bridge": self.bridge,
                "admin_token": self.admin_token, "redis_address": self.redis_address,
                "hosts": {n: (h.namespace, h.address) for n, h in self.hosts.items()}}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # --- faults --------------------------------------------------------------------------------
    def partition(self, name: str, others: list[str]) -> None:
        """Drop every packet between `name` and each of `others` (both ways); "redis" is the
        db host's Redis address alone."""
        host = self.hosts[name]
        for other in others:
            peer = self.hosts["db"] if other == "redis" else self.hosts[other]
            target = self.redis_address if other == "redis" else peer.address
            _ip("-n", host.namespace, "route", "add", "blackhole", f"{target}/32")
            host.blackholes.add(target)
            if other != "redis":  # (the db host's way back also serves PostgreSQL: left open)
                _ip("-n", peer.namespace, "route", "add", "blackhole", f"{host.address}/32")
                peer.blackholes.add(host.address)

    def heal(self, name: str) -> None:
        """Every partition of `name`, healed."""
        host = self.hosts[name]
        for target in list(host.blackholes):
            _ip("-n", host.namespace, "route", "del", "blackhole", f"{target}/32", check=False)
            host.blackholes.discard(target)
        for peer in self.hosts.values():
            if host.address in peer.blackholes:
                _ip("-n", peer.namespace, "route", "del", "blackhole", f"{host.address}/32", check=False)
                peer.blackholes.discard(host.address)

    # --- services on the db host ----------------------------------------------------------------------
    def start_database(self) -> str:
        """A PostgreSQL cluster of its own and Redis, both on the db host; the DATABASE_URL."""
        if PG_BIN is None:
            raise HostsUnavailable("PostgreSQL's server binaries are not installed (/usr/lib/postgresql/*/bin)")
        db = self.hosts["db"]
        # Outside the run directory (which may sit under a root-only /tmp path): postgres owns it.
        data = Path(tempfile.mkdtemp(prefix=f"sl{self.tag}-pgdata-"))
        self.scratch.append(data)
        shutil.chown(data, "postgres", "postgres")
        subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust",
                        "-U", "postgres"], check=True, capture_output=True)
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {self.subnet}.0/24 trust\n")
        db.stack.spawn("postgres", ["runuser", "-u", "postgres", "--", str(PG_BIN / "postgres"), "-D", str(data),
                                    "-c", f"listen_addresses={db.address}", "-c", "port=5432",
                                    "-c", f"unix_socket_directories={data}", "-c", "max_connections=300",
                                    "-c", "fsync=off"])
        db.stack.spawn("redis", ["redis-server", "--bind", self.redis_address, "--port", "6379", "--save", "",
                                 "--appendonly", "no", "--protected-mode", "no"])
        url = f"postgres://postgres@{db.address}:5432/postgres"
        deadline = time.monotonic() + 30
        while subprocess.run([str(PG_BIN / "pg_isready"), "-h", db.address, "-p", "5432"],
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL on the db host did not start; see {db.stack.log_dir}")
            time.sleep(0.2)
        return url

    def env(self, database_url: str) -> dict[str, str]:
        """What every Sluice process on these hosts is given."""
        return {"DATABASE_URL": database_url, "REDIS_URL": f"redis://{self.redis_address}:6379/0",
                "SLUICE_ALLOWED_HOSTS": ",".join(h.address for h in self.hosts.values()),
                "FAKEVENDOR_ADMIN_TOKEN": self.admin_token}

    # --- teardown ---------------------------------------------------------------------------------------
    def teardown(self) -> None:
        if not self.owner:
            for host in self.hosts.values():
                host.stack.stop_all()
            return
        for host in self.hosts.values():
            try:
                host.stack.stop_all()
            finally:
                host.kill_all()
                _ip("netns", "del", host.namespace, check=False)
        _ip("link", "del", self.bridge, check=False)
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def sweep() -> int:
        """Remove what a crashed run left (namespaces and bridges named sl…)."""
        removed = 0
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith("sl") and "-" in name:
                for pid in _ip("netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _ip("netns", "del", name, check=False)
                removed += 1
        for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
            name = line.split(":")[1].strip()
            if name.startswith("slbr"):
                _ip("link", "del", name, check=False)
        return removed

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def main() -> int:  # pragma: no cover - a manual check: python -m tasks.hosts
    try:
        Hosts.check()
    except HostsUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    print("network namespaces can be created here")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
