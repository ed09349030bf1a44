"""Warm converters: a small pool of running LibreOffice processes per lane, so a conversion costs
the conversion, not LibreOffice's start (as unoserver does).

A slot is a directory under SLUICE_DATA_DIR/engine/warm/<lane>/<n>/. A converter process takes a
slot by an exclusive lock on its `lock` file (so slots hold across processes), starts the slot's
instance if none runs, converts over UNO under the conversion's wall clock — through the slot's
bridge (Debian's python3 running `uno_convert.py --serve`, connected to the instance for its
whole life) or, while that is not listening yet, a one-shot `uno_convert.py` — and lets the slot
go. Each instance runs under a supervisor
(`python -m tasks.engine.warm SLOT ...`) that starts LibreOffice in its own process group with an
address-space and output-size limit and no network (as root), and ends it — the whole group —
after `recycle_after` conversions, when it has been idle for `idle_s`, or when a conversion
overran (the converter kills the supervisor's group then). The exports in FILTERS go warm;
everything else, and every conversion when Debian's python3-uno is missing, takes the cold path
(one LibreOffice per conversion).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tasks import engine

SYSTEM_PYTHON = "/usr/bin/python3"
CLIENT = Path(__file__).with_name("uno_convert.py")
# The UNO export filter of each (document family, format) a warm instance converts to ("name|options");
# the rest (a presentation's HTML) starts its own LibreOffice.
FILTERS = {
    ("writer", "pdf"): "writer_pdf_Export", ("calc", "pdf"): "calc_pdf_Export", ("impress", "pdf"): "impress_pdf_Export",
    ("writer", "html"): "HTML (StarWriter)", ("calc", "html"): "HTML (StarCalc)",
    ("writer", "txt"): "Text (encoded)|UTF8",
}
START_S = 20.0  # how long a fresh instance may take to accept connections
PIPE_NAME = "sluice-pipe"  # the file in an instance's profile naming the pipe it accepts on


def family(extension: str) -> str | None:
    ext = extension.lower()
    if ext in engine.WRITER:
        return "writer"
    if ext in engine.CALC:
        return "calc"
    if ext in engine.IMPRESS:
        return "impress"
    return None


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Debian's python3 can drive LibreOffice over UNO (python3-uno is installed)."""
    if not (engine.installed() and Path(SYSTEM_PYTHON).exists()):
        return False
    try:
        return subprocess.run([SYSTEM_PYTHON, "-c", "import uno"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _state(slot: Path) -> dict[str, Any]:
    try:
        return json.loads((slot / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def _write_state(slot: Path, **values: Any) -> None:
    state = {**_state(slot), **values}
    temp = slot / f".state.{os.getpid()}"
    temp.write_text(json.dumps(state))
    os.replace(temp, slot / "state.json")


def _alive(pid: int | None) -> bool:
    return _is(pid, b"tasks.engine.warm")


def _is(pid: int | None, marker: bytes) -> bool:
    """Whether `pid` is running and is the process its command line says (a pid can be reused)."""
    if not pid:
        return False
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def kill(slot: Path) -> None:
    """End the slot's instance: its supervisor's whole group (LibreOffice runs in its own)."""
    state = _state(slot)
    # LibreOffice and the UNO bridge lead their own groups; the supervisor (a daemon, not a group
    # leader) is one process.
    # The instance's pipe name is on each of its command lines (LibreOffice's group leader is
    # oosplash): the state may name processes long reaped, and a reused pid is never signalled.
    marker = str(state.get("pipe") or "tasks.engine.warm").encode()
    for pid, kill_one in ((state.get("soffice_pid"), os.killpg), (state.get("bridge_pid"), os.killpg),
                          (state.get("supervisor_pid"), os.kill)):
        if pid and _is(pid, marker):
            try:
                kill_one(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 2  # its files go once it is gone (a live one's never do)
    while _alive(state.get("supervisor_pid")) and time.monotonic() < deadline:
        time.sleep(0.02)
    _remove_leftovers(slot)
    (slot / "state.json").unlink(missing_ok=True)


def _own_paths(slot: Path, supervisor_pid: int) -> tuple[Path, Path]:
    """An instance's LibreOffice profile and bridge socket, named by its supervisor, so an ending
    instance never removes those of the one that replaced it (a socket path stays short)."""
    return slot / f"profile-{supervisor_pid}", slot / f"uno-{supervisor_pid}.sock"


def _pipe_name(profile: Path) -> str | None:
    try:
        return (profile / PIPE_NAME).read_text()
    except OSError:
        return None


def _remove_instance_files(profile: Path, pipe: str | None = None) -> None:
    """An ended instance's pipes in /tmp and its profile (its temporary files inside); `pipe`:
    its accepting pipe's name when known, else the one its profile names."""
    engine.remove_pipes(profile, pipe or _pipe_name(profile))
    shutil.rmtree(profile, ignore_errors=True)


def _remove_leftovers(slot: Path) -> None:
    """Remove the profiles, sockets and pipes of instances whose supervisor is gone (killed, not ended)."""
    for path in [*slot.glob("profile-*"), *slot.glob("uno-*.sock")]:
        pid = path.name.removeprefix("profile-").removeprefix("uno-").removesuffix(".sock")
        if pid.isdigit() and not _alive(int(pid)):
            if path.is_dir():
                _remove_instance_files(path)
            else:
                path.unlink(missing_ok=True)


def convert(source: Path, dest: Path, *, extension: str, root: Path, lane: str, pool: int, limits: dict[str, int],
            recycle_after: int, idle_s: float, deadline: float, fmt: str = "pdf") -> dict[str, int] | None:
    """Convert to `fmt` in a warm instance of this lane and say which one (its processes and how
    many conversions it has made); None when none can take it (the caller goes cold). Raises
    runner.ConversionFailed when the conversion itself fails or overruns."""
    from tasks.engine import ConversionFailed

    kind = family(extension)
    export = FILTERS.get((kind, fmt)) if kind else None
    if export is None or pool <= 0 or not available():
        return None
    for index in range(pool):
        slot = root / "warm" / lane / str(index)
        slot.mkdir(parents=True, exist_ok=True)
        with open(slot / "lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # another conversion holds this instance
            state = _state(slot)
            if not _alive(state.get("supervisor_pid")):
                _start(slot, limits=limits, recycle_after=recycle_after, idle_s=idle_s)
                state = _state(slot)
            pipe = state.get("pipe")
            if not pipe:
                return None
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    kill(slot)
                    raise ConversionFailed("engine_timeout", f"the conversion took longer than its {limits['wall_s']} s")
                try:
                    done = _via_bridge(slot, source, dest, export, remaining)
                    if done is None:  # no bridge (yet): a one-shot UNO client
                        done = subprocess.run([SYSTEM_PYTHON, str(CLIENT), pipe, str(source), str(dest), export],
                                              capture_output=True, timeout=remaining,
                                              env={"PATH": "/usr/bin:/bin", "HOME": str(slot)})
                except subprocess.TimeoutExpired:
                    kill(slot)  # an instance stuck on a document is not reused
                    raise ConversionFailed("engine_timeout",
                                           f"the conversion took longer than its {limits['wall_s']} s") from None
                if done.returncode == 3 and time.time() - _state(slot).get("started_at", 0) < START_S:
                    time.sleep(0.1)  # still starting
                    continue
                break
            if done.returncode != 0 or not dest.exists():
                crashed = not _alive(_state(slot).get("supervisor_pid")) or done.returncode == 3
                kill(slot)
                reason = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
                raise ConversionFailed("engine_out_of_memory" if b"bad_alloc" in done.stderr else "engine_crashed",
                                       "LibreOffice failed on the document" + (" and ended" if crashed else "")
                                       + f" ({reason[0][:200]})")
            state = _state(slot)
            _write_state(slot, conversions=state.get("conversions", 0) + 1, last_used=time.time())
            return {"supervisor_pid": state.get("supervisor_pid", 0), "soffice_pid": state.get("soffice_pid", 0),
                    "bridge_pid": state.get("bridge_pid", 0),
                    "conversion": state.get("conversions", 0) + 1}
    return None


def _via_bridge(slot: Path, source: Path, dest: Path, export: str, timeout: float) -> subprocess.CompletedProcess | None:
    """Convert through the slot's UNO bridge (a python3 kept connected to the instance), or None
    when it has none listening. A bridge that does not answer in time is a timeout."""
    import socket

    socket_path = _state(slot).get("socket")
    path = Path(socket_path) if socket_path else None
    if path is None or not path.exists():
        return None
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(max(timeout, 0.01))
    try:
        try:
            client.connect(str(path))
        except OSError:
            return None  # gone with its instance
        client.sendall(f"{source}\t{dest}\t{export}\n".encode())
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = client.recv(256)
            if not chunk:
                break
            reply += chunk
    except TimeoutError:
        raise subprocess.TimeoutExpired("uno bridge", timeout) from None
    except OSError:
        return None
    finally:
        client.close()
    code, _, reason = reply.decode(errors="replace").strip().partition(" ")
    if not code.isdigit():
        return None  # it ended while answering: the one-shot client says what the instance does
    return subprocess.CompletedProcess(["uno bridge"], int(code), b"", reason.encode())


def _start(slot: Path, *, limits: dict[str, int], recycle_after: int, idle_s: float) -> None:
    kill(slot)
    pipe = f"sluice-{os.getpid()}-{time.monotonic_ns()}"
    _write_state(slot, pipe=pipe, started_at=time.time(), last_used=time.time(), conversions=0)
    subprocess.run([sys.executable, "-m", "tasks.engine.warm", str(slot), pipe, str(limits["memory_mb"]),
                    str(limits["output_mb"]), str(recycle_after), str(idle_s)],
                   cwd=Path(__file__).resolve().parents[2], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=30, check=False)


def serve(slot: Path, pipe: str, memory_mb: int, output_mb: int, recycle_after: int, idle_s: float) -> None:
    """The supervisor: run the slot's LibreOffice until it is used up, idle, or gone."""
    from tasks.engine.runner import _isolated, _limits

    profile, sock = _own_paths(slot, os.getpid())
    command = _isolated([engine.soffice(), "--headless", "--invisible", "--nologo", "--norestore", "--nodefault",
                         "--nolockcheck", f"-env:UserInstallation=file://{profile}",
                         f"--accept=pipe,name={pipe};urp;StarOffice.ComponentContext"])
    scratch = profile / "tmp"  # its temporary files (the certificate store's) go with its profile
    scratch.mkdir(parents=True, exist_ok=True)
    (profile / PIPE_NAME).write_text(pipe)  # so whoever removes the profile removes the pipe too
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(slot), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
           "SAL_USE_VCLPLUGIN": "svp"}
    # CPU is bounded per conversion by its wall clock; the instance's own CPU limit is its whole life's.
    office = subprocess.Popen(command, cwd=slot, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, preexec_fn=_limits(3600, memory_mb, output_mb))
    bridge = subprocess.Popen([SYSTEM_PYTHON, str(CLIENT), "--serve", pipe, str(sock)], cwd=slot,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(slot)}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _write_state(slot, supervisor_pid=os.getpid(), soffice_pid=office.pid, bridge_pid=bridge.pid, socket=str(sock))

    ended = []

    def end() -> None:
        if ended:
            return  # a reaped pid may be reused: never signal it twice
        ended.append(True)
        for process in (office, bridge):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
        sock.unlink(missing_ok=True)
        _remove_instance_files(profile, pipe)  # its profile may be gone already (the data removed)

    try:
        while office.poll() is None:
            time.sleep(0.5)
            state = _state(slot)
            if state.get("pipe") != pipe:
                break  # the slot was restarted by someone else
            used_up = state.get("conversions", 0) >= recycle_after
            idle = time.time() - state.get("last_used", time.time()) > idle_s
            if (used_up or idle) and _retire(slot, pipe, end):
                return
    finally:
        end()
        _retire(slot, pipe, lambda: None)


def _retire(slot: Path, pipe: str, end) -> bool:
    """Retire the slot's instance if nobody is converting in it (its lock is free): under the lock
    it is ended (`end`) and then the slot's state removed — last, so a slot without state has no
    instance left — and the next conversion starts a new one."""
    with open(slot / "lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a conversion holds it; one that finds the instance gone restarts the slot
        end()
        if _state(slot).get("pipe") == pipe:
            (slot / "state.json").unlink(missing_ok=True)
        return True


def main() -> None:
    slot, pipe, memory_mb, output_mb, recycle_after, idle_s = sys.argv[1:7]
    engine.daemonize()
    serve(Path(slot), pipe, int(memory_mb), int(output_mb), int(recycle_after), float(idle_s))
    os._exit(0)


if __name__ == "__main__":
    main()
