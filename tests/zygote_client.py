"""The `python` that torchrun starts for each rank in the suite (`PYTHON_EXEC`, set by `tests/zygote.py`).

It asks the test process's zygote (a server that imported torch and dream_trainer once) for a forked
child that runs `python ARGS...` with this process's arguments, environment, working directory and
standard streams, then stands in for that child: signals sent to this process are passed on, and it ends
as the child ended (the same exit status, or killed by the same signal). The zygote kills the child if this
process dies first (SIGKILL). Where no zygote answers, it becomes the real interpreter (`exec`).

Run with `python -S`: it imports the standard library only, so it starts in ~20 ms instead of the ~5 s of
CPU that a rank's `import torch` (and `torch._dynamo`, with its first optimizer) takes.
"""

import contextlib
import json
import os
import signal
import socket
import struct
import sys

REAL_PYTHON = sys.executable  # replaced by the interpreter's path in the generated copy
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _real_python(pending: list[int]) -> None:
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    for signum in pending:  # what came before: as it would have ended the interpreter
        os.kill(os.getpid(), signum)
    os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])


def main() -> None:
    address = os.environ.get("DREAM_TRAINER_ZYGOTE", "")
    child = [0]
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if child[0]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], signum)
        else:
            pending.append(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
    except OSError:  # no zygote (a test that unset it, a run without one): the real interpreter
        conn.close()
        _real_python(pending)
    request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    header = struct.pack("!Q", len(request))
    reader = conn.makefile("r")
    try:
        socket.send_fds(conn, [header], [0, 1, 2])
        conn.sendall(request)
        first = reader.readline().split()
    except OSError:  # the zygote closed the connection (it ended): said below
        first = []
    if first == ["exec"]:  # interpreter options the zygote does not take
        conn.close()
        _real_python(pending)
    if not first or first[0] != "pid":  # the zygote ended before it forked
        log = os.path.join(os.path.dirname(address), "server.log")  # where the zygote says why (its imports failed?)
        sys.stderr.write(f"zygote_client: no child from the zygote at {address}; its log: {log}\n")
        sys.exit(1)
    child[0] = int(first[1])
    for signum in pending:
        forward(signum, None)
    end = reader.readline().split()
    if len(end) == 2 and end[0] == "exit":
        sys.exit(int(end[1]))
    if len(end) == 2 and end[0] == "signal":
        signum = int(end[1])
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    sys.stderr.write(f"zygote_client: the zygote at {address} ended before its child {child[0]} did\n")
    sys.exit(1)


main()
