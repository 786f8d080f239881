"""A zygote for the suite's Python processes: `python` forked from a server that imported torch once.

Every torchrun rank (and most other scripts) the suite starts is a `python` that imports torch, dream_trainer
and (with its first optimizer) torch._dynamo: ~5 s of CPU each, the larger part of what the suite cost on 2
cores. torchrun starts its ranks with `$PYTHON_EXEC -u script ...` (torch.distributed.run). The run's first
process (xdist's controller, whose workers inherit the variables, or pytest without -n) sets `PYTHON_EXEC` to
`zygote_client.py` (`start()`, from `tests/conftest.py`, which also has xdist start its workers with it; tests
start their own scripts with it through `helpers.python()`, `run_python_forked`, `torchrun()`), which asks this
server for a forked child that runs `python -u script ...` with the client's arguments, environment, working
directory and standard streams, and stands in for it: torchrun, the launch and the test see a process that gets
the signals sent to it and ends as the child ended. What the child runs is unchanged: torchrun's agent,
rendezvous and restarts, the rank's environment, its own pid (what ranks tell each other and what tests
signal through them: `forked_child`), its loader workers.

Differences from a fresh interpreter, by design: modules in `PRELOAD` are imported already (with the
environment of the server's start: variables torch reads at import come from there; OMP_NUM_THREADS is
applied to torch's thread count); every child of one server has the same string-hash seed; the rank's
parent is the server, not torchrun (the client's pid is what torchrun knows). A test that needs the real
interpreter starts torchrun without `PYTHON_EXEC`/`DREAM_TRAINER_ZYGOTE` in its environment, or with
`DREAM_TRAINER_ZYGOTE=` empty: the client then `exec`s the real `python`.

Run as `python zygote.py SOCKET`: it serves until its parent (the process that started it) ends or it gets
SIGTERM, then kills what it forked that still runs.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Imported once by the server; a child starts with them. (What most ranks import anyway: torch.distributed's
# pieces that dream_trainer loads when a process group starts, the elastic error recorder.) Not torchmetrics,
# though xdist's workers and Lightning's scripts import it (~4 s of CPU with transformers installed): a child's
# full collections walk, and so copy, every object it inherits (2026-12-08: a tiny trainer's fit then three
# gc.collect() took 1.15 s with it preloaded, 0.69 s without), and whole runs of the suite with it (411-432 s,
# three) differed from runs without it (427-432 s, two) by no more than two runs of one tree do here.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.utils.data",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.nn.parallel",
    "dream_trainer",
    "dream_trainer.callbacks",
    "helpers",
)
ENV_SOCKET = "DREAM_TRAINER_ZYGOTE"
CHILD_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


# --- in the process that starts it --------------------------------------------------------------------------------
def start() -> None:
    """Start this process's zygote (in the background: it imports `PRELOAD` while the tests start) and point
    `PYTHON_EXEC` at the client, so that every torchrun the tests start from here on forks its ranks from it.
    The server ends with `stop()` or with this process."""
    folder = Path(tempfile.mkdtemp(prefix="dream-trainer-zygote-"))
    address = str(folder / "socket")
    client = folder / "python"
    source = (HERE / "zygote_client.py").read_text()
    source = source.replace("REAL_PYTHON = sys.executable", f"REAL_PYTHON = {sys.executable!r}", 1)
    client.write_text(f"#!{sys.executable} -S\n{source}")
    client.chmod(0o755)
    log = open(folder / "server.log", "wb")  # noqa: SIM115 - the server's, for as long as it runs
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__)), address], stdin=subprocess.DEVNULL, stdout=log, stderr=log
    )
    log.close()
    os.environ["PYTHON_EXEC"] = str(client)
    os.environ[ENV_SOCKET] = address

    _servers.append((server, folder))
    atexit.register(stop)


def stop() -> None:
    """End this process's zygote (and what it forked that still runs)."""
    while _servers:
        server, folder = _servers.pop()
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(10)
        if server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)


_servers: list[tuple[subprocess.Popen[bytes], Path]] = []


def client() -> str | None:
    """The client to start a `python` with (`PYTHON_EXEC`), or None where this process has no zygote (or it is
    turned off: `DREAM_TRAINER_ZYGOTE` empty)."""
    return os.environ.get("PYTHON_EXEC") if os.environ.get(ENV_SOCKET) else None


def carried(env: dict[str, str]) -> dict[str, str]:
    """`env` with this process's zygote variables where it lacks them: its `python`s fork from the zygote."""
    return {**{k: os.environ[k] for k in ("PYTHON_EXEC", ENV_SOCKET) if k in os.environ}, **env}


def turned_off(env: dict[str, str]) -> dict[str, str]:
    """`env` without the zygote: a torchrun or client started with it runs real interpreters."""
    return {**{k: v for k, v in env.items() if k != "PYTHON_EXEC"}, ENV_SOCKET: ""}


def forked_child(pid: int) -> int | None:
    """The pid of the process that the zygote client `pid` stands in for (forked by this process's zygote), or
    None when `pid` is no such client (or its child has ended)."""
    address = os.environ.get(ENV_SOCKET)
    if not address:
        return None
    try:
        return int((Path(address).parent / "pids" / str(pid)).read_text())
    except (OSError, ValueError):
        return None


# --- the server -----------------------------------------------------------------------------------------
def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(30)
    data, fds, _, _ = socket.recv_fds(conn, 8, 3)
    while len(data) < 8:
        more = conn.recv(8 - len(data))
        if not more:
            raise ConnectionError("the client left before its request")
        data += more
    (size,) = struct.unpack("!Q", data)
    body = b""
    while len(body) < size:
        more = conn.recv(min(1 << 20, size - len(body)))
        if not more:
            raise ConnectionError("the client left before its request")
        body += more
    conn.settimeout(None)
    return json.loads(body), fds


@functools.cache
def _fresh_sys_path(pythonpath: str) -> tuple[str, ...]:
    """`sys.path[1:]` of a new `python` with this PYTHONPATH (its first entry is the script's folder)."""
    code = "import json, sys; print(json.dumps(sys.path[1:]))"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return tuple(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, env=env).stdout))


def _command(argv: list[str]) -> tuple[str, str, list[str], bool] | None:
    """`python ARGV` as (kind, target, argv, unbuffered), kind one of script/-m/-c; None for what the zygote
    does not run (other interpreter options): the client then runs the real interpreter."""
    unbuffered = False
    i = 0
    while i < len(argv) and argv[i] == "-u":
        unbuffered, i = True, i + 1
    if i >= len(argv):
        return None
    if argv[i] in ("-m", "-c"):
        if i + 1 >= len(argv):
            return None
        return argv[i], argv[i + 1], argv[i + 2 :], unbuffered
    if argv[i].startswith("-"):
        return None
    return "script", argv[i], argv[i + 1 :], unbuffered


def _another_dream_trainer(command: tuple[str, str, list[str], bool], cwd: str, path: tuple[str, ...]) -> bool:
    """Whether the child's `sys.path` finds a dream_trainer other than the one imported here (a test that runs
    a copy of the package): such a command runs in the real interpreter. (The editable install's finder comes
    after the path entries, so a package on the path wins.)"""
    kind, target = command[0], command[1]
    first = str(Path(cwd, target).resolve().parent) if kind == "script" else cwd
    loaded = Path(sys.modules["dream_trainer"].__file__ or "").resolve()
    for entry in (first, *path):
        candidate = Path(cwd, entry, "dream_trainer", "__init__.py")
        if candidate.is_file():
            return candidate.resolve() != loaded
    return False


def _exit_code(exc: SystemExit) -> int:
    """The status `raise SystemExit(code)` gives a process, as the interpreter computes it (a non-int code is
    printed to stderr, status 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(
    request: dict[str, Any], fds: list[int], command: tuple[str, str, list[str], bool], path: tuple[str, ...]
) -> None:
    """In the forked child: become `python ARGV` and never return."""
    import atexit as _atexit
    import random
    import runpy
    import threading
    import types

    import torch

    kind, target, rest, unbuffered = command
    code = 1
    interrupted = False
    try:
        os.setsid()  # as torchrun's Popen(start_new_session=True) makes each rank a group of its own
        for fd, new in zip((0, 1, 2), fds, strict=True):
            os.dup2(new, fd)
            os.close(new)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        unbuffered = unbuffered or bool(env.get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=os.isatty(stream.fileno()), write_through=unbuffered)
        if env.get("OMP_NUM_THREADS", "").isdigit():  # torchrun sets it for its ranks; torch reads it lazily
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        random.seed()  # a fresh interpreter's `random` starts from os.urandom, not from the server's state
        if kind == "-m":
            sys.argv, sys.path[:] = ["-m", *rest], [request["cwd"], *path]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "-c":
            sys.argv, sys.path[:] = ["-c", *rest], ["", *path]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            script = str(Path(target).resolve())
            sys.argv, sys.path[:] = [target, *rest], [str(Path(script).parent), *path]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # as the interpreter does: the traceback on stderr, exit status 1
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        while tb is not None and tb.tb_frame.f_code.co_filename.endswith(("runpy.py", "<frozen runpy>")):
            tb = tb.tb_next
        with contextlib.suppress(BaseException):
            sys.excepthook(type(exc), exc, exc.with_traceback(tb).__traceback__)
        interrupted = isinstance(exc, KeyboardInterrupt)
        code = 1
    finally:
        # The interpreter's own exit, in its order: non-daemon threads joined, atexit handlers, streams flushed.
        try:
            threading._shutdown()  # type: ignore[attr-defined]
            _atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(BaseException):
                    stream.flush()
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            code = 1
        if interrupted:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _kill(pid: int) -> None:
    """SIGKILL to a child's group (it made one: its loader workers go with it), and to the child itself (in case
    it had not made it yet)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


def serve(address: str) -> None:
    owner = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)  # clients that come while the imports below run wait in the backlog
    sys.path.insert(0, str(HERE))
    for name in PRELOAD:
        importlib.import_module(name)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    stopping = [False]

    def on_term(signum: int, frame: Any) -> None:
        stopping[0] = True

    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGTERM, on_term)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    selector.register(wake_r, selectors.EVENT_READ, None)
    children: dict[int, socket.socket | None] = {}  # pid -> its client's connection (None once it left)
    stand_in: dict[int, Path] = {}  # pid -> pids/<its client's pid>, holding pid (`forked_child`)
    (Path(address).parent / "pids").mkdir(exist_ok=True)

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = children.pop(pid, None)
            with contextlib.suppress(OSError, KeyError):
                stand_in.pop(pid).unlink()
            if conn is None:
                continue
            if os.WIFSIGNALED(status):
                line = f"signal {os.WTERMSIG(status)}\n"
            else:
                line = f"exit {os.waitstatus_to_exitcode(status)}\n"
            with contextlib.suppress(OSError):
                conn.sendall(line.encode())
            selector.unregister(conn)
            conn.close()

    def accept() -> None:
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            request, fds = _read_request(conn)
            command = _command(request["argv"])
            path = _fresh_sys_path(request["env"].get("PYTHONPATH", ""))  # computed once per PYTHONPATH, here
            if command is None or len(fds) != 3 or _another_dream_trainer(command, request["cwd"], path):
                conn.sendall(b"exec\n")
                conn.close()
                return
            # Signals wait until the child has the handlers a fresh interpreter has (not this server's).
            signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_SIGNALS)
            try:
                pid = os.fork()
            except OSError:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_SIGNALS)
                raise
            if pid == 0:
                try:
                    selector.close()
                    listener.close()
                    for other in children.values():
                        if other is not None:
                            other.close()
                    conn.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    for signum in (signal.SIGCHLD, signal.SIGTERM):
                        signal.signal(signum, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_SIGNALS)
                    _child(request, fds, command, path)
                finally:
                    os._exit(1)  # `_child` never returns: nothing of the server runs on in the child
            signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_SIGNALS)
            children[pid] = conn
            selector.register(conn, selectors.EVENT_READ, pid)
            conn.sendall(f"pid {pid}\n".encode())
            with contextlib.suppress(OSError):  # for `forked_child`: which client stands in for this child
                client, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                stand_in[pid] = Path(address).parent / "pids" / str(client)
                stand_in[pid].write_text(str(pid))
        except (OSError, ValueError, ConnectionError) as exc:
            print(f"zygote: a request failed: {exc!r}", file=sys.stderr, flush=True)
            conn.close()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    try:
        while not stopping[0] and os.getppid() == owner:
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj is listener:
                    accept()
                elif key.fileobj == wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                else:  # a client's connection: it only ever closes (its process died): end its child too
                    pid = key.data
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    with contextlib.suppress(OSError):
                        if conn.recv(1):
                            continue
                    selector.unregister(conn)
                    conn.close()
                    children[pid] = None
                    _kill(pid)
            reap()
    finally:
        for pid in list(children):
            _kill(pid)
        with contextlib.suppress(OSError):
            os.unlink(address)


if __name__ == "__main__":
    serve(sys.argv[1])
    # Nothing is left to finalize: skip the interpreter's teardown of everything PRELOAD imported (~2 s, which
    # `stop()` would wait for).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
