"""Fresh processes without fresh imports: the suite's children forked from a pre-imported server.

Every child the suite starts (``python -m lit_moe.cli ...``, a layout file's ``--worker`` ranks) spent
5-12 s importing torch, Lightning and lit_moe before doing a second of work; that was most of the
suite's CPU time. Instead, each test process starts one server: a fresh interpreter (``python
launch_pool.py SOCKET``) that imports those modules once and nothing else (no pytest state, no
process group, no Trainer), then forks a child per request. A child is what a fresh interpreter is
after its imports: it takes the environment, working directory, ``sys.argv`` and output file of the
command it stands for, runs the module or script as ``__main__`` and exits with its status (the
``atexit`` handlers run, then ``os._exit``). Each child leads its own session, so a kill reaches what
it started.

``run(argv, ...)`` stands for ``subprocess.run([sys.executable, *argv], ...)``; ``run_ranks(world,
argv, ...)`` for ``torchrun --standalone --nproc_per_node=world ...``: one child per rank with the
variables torchrun gives its workers (a failing rank ends the others after a grace, as torchrun's
agent does). Launches whose subject is a launcher (torchrun's restarts, Lightning's own start of a
second process, srun's variables) keep the real commands.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

# What the server imports once; every child has them imported already.
PRELOAD = ("torch", "torch.distributed.run", "lightning.pytorch", "lit_moe.cli")

_server: tuple[subprocess.Popen, str] | None = None


# ---------------------------------------------------------------- the test process's side

def _connect() -> socket.socket:
    """A connection to this process's server, started on first use (``OMP_NUM_THREADS=1`` and the
    repository on ``PYTHONPATH`` as ``child_env`` gives a fresh child: the OpenMP runtime reads its
    thread count when torch loads, in the server)."""
    global _server
    if _server is None or _server[0].poll() is not None:
        from helpers import ROOT, child_env

        path = os.path.join(tempfile.mkdtemp(prefix="lit_moe_pool_"), "sock")
        proc = subprocess.Popen([sys.executable, __file__, path], env=child_env(ROOT / "tests"),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        ready = proc.stdout.readline()   # after the imports
        if ready.strip() != "ready":
            raise RuntimeError(f"the launch pool's server did not start: {ready!r}")
        _server = (proc, path)
        atexit.register(proc.kill)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(_server[1])
    return conn


class _Child:
    """One forked child: its pid (a session leader) and, once it ends, its exit status."""

    def __init__(self, argv: Sequence[str], env: dict, cwd: Path | str, out: Path, err: Path | None = None):
        if not os.path.isdir(cwd):   # as subprocess refuses it, before anything starts
            raise FileNotFoundError(f"no such directory: {cwd}")
        self.conn = _connect()
        request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "out": str(out), "err": str(err or out)}
        self.conn.sendall(json.dumps(request).encode() + b"\n")
        self.replies = b""
        self.pid = int(self._reply(None))
        assert self.pid > 0, self.pid    # (a kill of group 0 would end the test process's own group)
        self.code: int | None = None

    def _reply(self, timeout: float | None) -> str | None:
        """The server's next line, or None when ``timeout`` seconds pass first ("" when it hung up)."""
        import select

        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.replies:
            wait = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self.conn], [], [], wait)[0]:
                return None
            chunk = self.conn.recv(256)
            if not chunk:
                return ""
            self.replies += chunk
        line, self.replies = self.replies.split(b"\n", 1)
        return line.decode()

    def poll(self, timeout: float = 0.0) -> int | None:
        if self.code is None:
            line = self._reply(timeout)
            if line is None:
                return None
            self.code = int(line) if line.strip() else -signal.SIGKILL
            self.conn.close()
        return self.code

    def kill(self) -> None:
        if self.code is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.poll(10.0)


def run(argv: Sequence[str], *, env: dict, cwd: Path | str, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, *argv], env=env, cwd=cwd, capture_output=True, text=True,
    timeout=timeout)`` in a forked child."""
    with tempfile.TemporaryDirectory(prefix="lit_moe_child_") as where:
        out, err = Path(where) / "out.log", Path(where) / "err.log"
        child = _Child(argv, env, cwd, out, err)
        if child.poll(timeout) is None:
            child.kill()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess([sys.executable, *argv], child.code, _read(out), _read(err))


def torchrun_env(rank: int, world: int, port: int, run_id: str) -> dict:
    """The variables ``torchrun --standalone`` gives worker ``rank`` of a one-node job: ``MASTER_PORT``
    is the agent's store, which the workers join as clients (``TORCHELASTIC_USE_AGENT_STORE``), so a
    process that fits twice rendezvouses afresh each time as under torchrun (lit_moe.runtime.elastic)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


class Ranks:
    """``torchrun --standalone --nproc_per_node=WORLD ARGV`` started: each rank a forked child with
    torchrun's variables, its output in a file of a temporary directory; this process holds the agent's
    TCP store (on a port it bound itself: no port race). ``wait`` ends it."""

    def __init__(self, world: int, argv: Sequence[str], *, env: dict, cwd: Path | str):
        from datetime import timedelta

        import torch.distributed as dist

        self.argv = list(argv)
        self.where = tempfile.TemporaryDirectory(prefix="lit_moe_ranks_")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=900))
        port = self.store.port
        self.logs = [Path(self.where.name) / f"rank{r}.log" for r in range(world)]
        self.children = [_Child(argv, {**env, **torchrun_env(r, world, port, f"pool_{port}")}, cwd, self.logs[r])
                         for r in range(world)]

    def wait(self, timeout: float, grace: float = 20.0) -> subprocess.CompletedProcess:
        """The exit status is the first failing rank's (0 when all succeed), ``stdout`` every rank's output,
        rank by rank. When a rank fails the others get ``grace`` seconds to print what they reached, then are
        killed, as torchrun's agent stops the group."""
        end, failed_at = time.monotonic() + timeout, None
        try:
            # every child polled each round (a failed rank must be seen while its peer still runs)
            while None in [c.poll(0.05 / len(self.children)) for c in self.children]:
                now = time.monotonic()
                if now > end:
                    raise subprocess.TimeoutExpired(["torchrun", *self.argv], timeout, output=self.output())
                failed = [c.code for c in self.children if c.code not in (None, 0)]
                if failed_at is None and failed:
                    failed_at, first_failure = now, failed[0]
                if failed_at is not None and now > failed_at + grace:
                    break
        finally:
            self.stop()
        text = self.output()
        self.where.cleanup()
        self.store = None
        code = first_failure if failed_at is not None else next((c.code for c in self.children if c.code != 0), 0)
        return subprocess.CompletedProcess(["torchrun", *self.argv], code, text, "")

    def stop(self) -> None:
        for c in self.children:
            c.kill()

    def output(self) -> str:
        return "".join(f"[rank {r}]\n{_read(log)}" for r, log in enumerate(self.logs))


def run_ranks(world: int, argv: Sequence[str], *, env: dict, cwd: Path | str, timeout: float
              ) -> subprocess.CompletedProcess:
    """``Ranks(...).wait(timeout)``."""
    return Ranks(world, argv, env=env, cwd=cwd).wait(timeout)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# ---------------------------------------------------------------- the server's side

def _become(argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """In the forked child: become ``python ARGV`` in ``cwd`` with ``env``, output to ``out`` and ``err``."""
    import runpy
    import traceback

    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    for target, path in ((1, out), (2, err)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)   # line-buffered, as PYTHONUNBUFFERED gives
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.chdir(cwd)
    code = 0
    try:
        if argv[0] == "-m":
            # as ``python -m``: the module runs as ``__main__`` only (its preloaded copy stays out of the way;
            # what it imports is still preloaded)
            sys.modules.pop(argv[1], None)
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = str(Path(argv[0]).resolve())
            sys.argv = [script, *argv[1:]]
            sys.path.insert(0, str(Path(script).parent))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(path: str) -> None:
    """Import ``PRELOAD``, say ``ready``, then fork a child per connection: reply its pid, later its
    exit status. Ends when the test process that started it is gone."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(0.05)
    parent = os.getppid()
    print("ready", flush=True)
    running: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except (TimeoutError, socket.timeout):
            conn = None
        if conn is not None:
            conn.settimeout(None)
            line = conn.makefile("r").readline()
            if not line.strip():    # a connection that only probed the server
                conn.close()
                continue
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                try:   # the child never returns into this loop, whatever fails
                    listener.close()
                    conn.close()
                    for other in running.values():
                        other.close()
                    _become(request["argv"], request["env"], request["cwd"], request["out"], request["err"])
                finally:
                    os._exit(1)
            running[pid] = conn
            conn.sendall(f"{pid}\n".encode())
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                try:
                    running.pop(pid).sendall(f"{code}\n".encode())
                except OSError:
                    pass


if __name__ == "__main__":
    serve(sys.argv[1])
