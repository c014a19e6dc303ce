"""Child processes of the local stack: start in their own session, wait until they answer, stop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ordering_layer.errors import StackError

START_TIMEOUT = 90.0
_STOP_TIMEOUT = 30.0


def alive(pid: int | None) -> bool:
    """True when ``pid`` names a running process (not a zombie)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return True


def spawn(command: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> int:
    """Start ``command`` in its own session (``env``: its environment, default this process's),
    output appended to ``log``; return its pid, which is also its process group's id."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=dict(env) if env is not None else None)
    return proc.pid


def wait_until(check: Callable[[], object], what: str, pid: int, log: Path, timeout: float = START_TIMEOUT) -> None:
    """Poll ``check()`` until it is true; fail early when the process died, naming its log.

    Raises:
        StackError: the process exited, or ``check`` stayed false for ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise StackError(f"{what} exited during start; last lines of {log}:\n{tail}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not answering yet is the expected state here
            pass
        time.sleep(0.2)
    raise StackError(f"{what} did not answer within {timeout:.0f} s; see {log}")


def stop(pid: int | None, *, kill: bool, group: bool = False) -> None:
    """Stop a process (SIGTERM, or SIGKILL when ``kill``; SIGKILL after 30 s anyway) and reap it.

    With ``group`` the signals go to its whole process group (a process started by ``spawn`` and
    the children it started, which stay in its group), sent while the process itself runs.
    """
    if not alive(pid):
        return
    assert pid is not None
    send = os.killpg if group else os.kill
    with contextlib.suppress(ProcessLookupError):
        send(pid, signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            send(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.05)
    # Collect the exit status when the process is our child, so it does not linger as a zombie.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` readable by the owner only (keys, configs holding passwords)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)
