"""A real S3-compatible server for tests, with a fault-injecting proxy in front of it.

Import it as ``from s3_faults import S3Server`` (``tests/`` is on ``sys.path``, as for ``helpers``)::

    with S3Server(tmp_path) as s3:
        s3.create_bucket("ckpt")
        s3.fail_next(2, 503, match="PUT")          # the next two PUTs get SlowDown
        subprocess.run([...], env={**os.environ, **s3.env()})
        assert s3.objects("ckpt") == {...}          # read from moto directly, without faults

Why a server and not moto's in-process mock: the clients under test are other processes (and get killed with
SIGKILL mid-upload), and s3fs talks through aiohttp, which an in-process mock of botocore does not see.
The server is moto in server mode, a subprocess; the proxy is ours, threads in the test process, so it lives
on when a client process is killed and can say what was in flight at that moment. Clients talk only to the
proxy (`endpoint`, `env()`); the test reads what really got stored from moto itself (`moto_endpoint`,
`client()`, `objects()`).

Faults (each applies to the requests that arrive after the call; "METHOD path" is e.g.
``"PUT /bucket/key?partNumber=1&uploadId=..."``, and ``match`` is a substring of it):

- ``fail_next(n, status, match)``: an S3 XML error reply (503 -> SlowDown, 500 -> InternalError), not forwarded.
- ``reset_next(n, match)``: the connection is closed with a TCP reset once the request's headers (and a
  little of its body) are read, not forwarded.
- ``slow_uploads(seconds, match)``: each request with a body takes at least ``seconds`` to be received.

A request whose client has closed its connection by the time the body is received (a client killed
mid-upload) is never forwarded, so killing a client inside a `slow_uploads` window means its upload never lands
(counted as "abandoned"; see `_ProxyHandler._client_gone`).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

# Headers that describe one connection, not the message: never relayed (RFC 9110 7.6.1). Content-Length is
# set again from the body actually relayed; Expect is answered by the proxy itself (the 100 Continue).
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
_ERROR_CODES = {
    400: ("BadRequest", "Bad request."),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}
_CHUNK = 64 * 1024
_RESET_PEEK = 1024  # body bytes read before a reset: the client is mid-upload, not yet waiting for a reply


def _free_port() -> int:
    """A port nothing listens on now (the kernel's pick for port 0); moto binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _error_body(status: int) -> bytes:
    """A well-formed S3 error document, so botocore classifies the reply (throttling, 5xx) as for real S3."""
    code, message = _ERROR_CODES.get(status, ("InternalError" if status >= 500 else "InvalidRequest", "Fault."))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>fault</RequestId></Error>"
    ).encode()


@dataclass
class _Fault:
    kind: str  # "fail" or "reset"
    remaining: int
    match: str
    status: int = 503


@dataclass(frozen=True)
class Event:
    """One request the proxy handled: what it was, how it ended, how long it took (for `describe`)."""

    method: str
    path: str
    outcome: str  # moto's status relayed ("200"), "fault 503", "reset", "client gone ...", "502 (moto: ...)"
    seconds: float


class _ProxyState:
    """What the handler threads share with the test: the faults, the counts, what is in flight.

    One lock for all of it; the condition on it wakes `wait_in_flight` when a request starts."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.lock = threading.Lock()
        self.started = threading.Condition(self.lock)
        self.faults: list[_Fault] = []
        self.slow_seconds = 0.0
        self.slow_match = ""
        self.counts = {"requests": 0, "forwarded": 0, "failed": 0, "reset": 0, "slowed": 0, "abandoned": 0}
        self.in_flight: dict[int, str] = {}  # id of the handler's request -> "METHOD path"
        self.events: deque[Event] = deque(maxlen=500)

    def begin(self, key: int, label: str) -> tuple[_Fault | None, float]:
        """Register a new request; take the first fault it matches (one use of it) and its upload delay."""
        with self.lock:
            self.counts["requests"] += 1
            self.in_flight[key] = label
            self.started.notify_all()
            fault = None
            for f in self.faults:
                if f.remaining > 0 and f.match in label:
                    f.remaining -= 1
                    fault = f
                    break
            self.faults = [f for f in self.faults if f.remaining > 0]
            slow = self.slow_seconds if self.slow_seconds > 0 and self.slow_match in label else 0.0
            return fault, slow

    def end(self, key: int, event: Event, count: str | None) -> None:
        """The request is done (its reply is about to be sent, or its connection reset): no longer in flight."""
        with self.lock:
            self.in_flight.pop(key, None)
            self.events.append(event)
            if count is not None:
                self.counts[count] += 1

    def bump(self, count: str) -> None:
        with self.lock:
            self.counts[count] += 1


class _ProxyServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that knows its open connections, so `stop` can end the keep-alive ones (a client's
    pooled connection would otherwise outlive the proxy, its thread blocked reading the next request)."""

    daemon_threads = True
    block_on_close = False  # `stop` joins the threads itself, with a timeout
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], state: _ProxyState) -> None:
        self.state = state
        self.conns: set[socket.socket] = set()
        self.threads: set[threading.Thread] = set()
        self.conns_lock = threading.Lock()
        super().__init__(address, _ProxyHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        t = threading.Thread(target=self._run, args=(request, client_address), daemon=True, name="s3-proxy-conn")
        with self.conns_lock:
            self.conns.add(request)
            self.threads.add(t)
        t.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that died mid-request (killed by the test) resets its connection: expected, not printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def _run(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self.conns_lock:
                self.conns.discard(request)
                self.threads.discard(threading.current_thread())

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close the listening socket (new connections are refused), end every open one."""
        self.shutdown()
        self.server_close()
        with self.conns_lock:
            conns, threads = list(self.conns), list(self.threads)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _ProxyHandler(BaseHTTPRequestHandler):
    """Relays one connection's requests to moto, or applies the fault the request matches."""

    protocol_version = "HTTP/1.1"  # keep-alive, as S3; also makes the base class answer Expect: 100-continue
    timeout = 60  # an idle keep-alive connection is closed after this (its thread ends)
    server: _ProxyServer
    _t0 = 0.0  # when the current request began
    _done = True  # whether the current request is finished (counted, out of `in_flight`)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the state's `events` keep what a failing test needs (`S3Server.describe`)."""

    def _handle(self) -> None:
        state = self.server.state
        self._t0 = time.monotonic()
        self._done = False
        fault, slow = state.begin(id(self), f"{self.command} {self.path}")
        try:
            if fault is not None and fault.kind == "reset":
                self._read_some(_RESET_PEEK)
                self._finish("reset", "reset")
                self._reset()
                return
            body = self._read_body(slow)
            if slow > 0 and body is not None:
                state.bump("slowed")
            if body is not None and self._client_gone():
                self.close_connection = True
                self._finish("client gone", "abandoned")
                return
            if fault is not None:
                self._finish(f"fault {fault.status}", "failed")
                self._reply_error(fault.status)
                return
            self._forward(body)
        except ConnectionError as e:  # the client went away mid-body (a no-op once the reply has begun)
            self.close_connection = True
            self._finish(f"client gone ({type(e).__name__}: {e})", "abandoned")
        except Exception as e:  # a malformed request, or a failure writing the reply: end this connection
            self.close_connection = True
            self._finish(f"proxy error {type(e).__name__}: {e}", None)
        finally:
            self._finish("proxy error", None)

    def _finish(self, outcome: str, count: str | None) -> None:
        """The request is no longer in flight, and counted: done before the reply's first byte is sent, so a
        client that has its reply sees the counts and `in_flight` already updated. Once per request."""
        if not self._done:
            self._done = True
            event = Event(self.command, self.path, outcome, time.monotonic() - self._t0)
            self.server.state.end(id(self), event, count)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _handle

    # --- the request body ---------------------------------------------------------------------------------
    def _body_pieces(self) -> Iterator[bytes]:
        """The request body as it arrives: by Content-Length, or decoded from Transfer-Encoding: chunked
        (aiohttp sends a stream of unknown length that way); moto then gets it with a Content-Length."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size_line = self.rfile.readline(65537)
                if not size_line:
                    raise ConnectionError("client closed the connection inside a chunked body")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers: dropped
                    return
                left = size
                while left:
                    piece = self.rfile.read(min(left, _CHUNK))
                    if not piece:
                        raise ConnectionError("client closed the connection inside a chunk")
                    left -= len(piece)
                    yield piece
                self.rfile.readline(65537)  # the CRLF after the chunk
        else:
            left = int(self.headers.get("Content-Length") or 0)
            while left:
                piece = self.rfile.read(min(left, _CHUNK))
                if not piece:
                    raise ConnectionError("client closed the connection inside the body")
                left -= len(piece)
                yield piece

    def _has_body(self) -> bool:
        return "Content-Length" in self.headers or "chunked" in self.headers.get("Transfer-Encoding", "").lower()

    def _read_body(self, slow: float) -> bytes | None:
        """The whole body (None if the request has no body headers). With `slow`, the pieces are spread over
        at least `slow` seconds, so a test can act while the upload is in flight."""
        if not self._has_body():
            return None
        length = self.headers.get("Content-Length")
        pieces = max(1, -(-int(length) // _CHUNK)) if length and slow > 0 else 1
        t0, parts = time.monotonic(), []
        for i, piece in enumerate(self._body_pieces()):
            parts.append(piece)
            if slow > 0:
                time.sleep(max(0.0, t0 + slow * min(i + 1, pieces) / pieces - time.monotonic()))
        body = b"".join(parts)
        if slow > 0 and body:
            time.sleep(max(0.0, t0 + slow - time.monotonic()))  # a chunked body of unknown length: the rest
        return body

    def _client_gone(self) -> bool:
        """Whether the client closed its connection (exited, was killed) after sending its whole body.

        Such a request is not forwarded: no S3 client half-closes and waits for a reply, so this is a client
        that died mid-upload. Its last bytes still arrived only because the kernel's socket buffers took the
        (small, test-sized) body before it died; a real upload as slow as `slow_uploads` makes it would have
        been cut short, and a test that kills a client inside that window means the upload never lands."""
        sock = self.connection
        timeout = sock.gettimeout()
        sock.settimeout(0.0)  # with a timeout, recv would first wait for data to arrive
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False  # connected, nothing more sent: waiting for the reply
        except OSError:
            return True  # reset
        finally:
            sock.settimeout(timeout)

    def _read_some(self, n: int) -> None:
        """Up to `n` body bytes, so that a reset finds the client mid-upload (the bytes are dropped)."""
        if not self._has_body():
            return
        got = 0
        with contextlib.suppress(OSError, ConnectionError, ValueError):
            for piece in self._body_pieces():
                got += len(piece)
                if got >= n:
                    break

    # --- the replies --------------------------------------------------------------------------------------
    def _reset(self) -> None:
        """Close with a TCP RST (SO_LINGER on, 0 s), as a dropped connection or a dead load balancer does."""
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()  # marks it closed; the fd goes with the last makefile reference:
        self.rfile.close()  # now, with the RST (wfile holds no reference; shutdown_request finds it closed)

    def _reply_error(self, status: int) -> None:
        body = _error_body(status)
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", "fault")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes | None) -> None:
        """Send the request to moto as the client sent it (method, path and query, headers, Host included, so
        a SigV4 signature still matches) and relay the reply."""
        conn = http.client.HTTPConnection(*self.server.state.upstream, timeout=120)
        try:
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() not in ("content-length", "expect"):
                        conn.putheader(name, value)
                if body is not None:
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body)
                resp = conn.getresponse()
                data = resp.read()  # empty for HEAD: http.client knows the method
            except (OSError, http.client.HTTPException) as e:  # moto is gone (killed, crashed): a 502, as a gateway
                self.close_connection = True
                self._finish(f"502 (moto: {type(e).__name__}: {e})", None)
                self._reply_error(502)
                return
            self._finish(str(resp.status), "forwarded")
            self.send_response_only(resp.status, resp.reason)
            for name, value in resp.getheaders():
                lower = name.lower()
                if lower in _HOP_BY_HOP or (lower == "content-length" and self.command != "HEAD"):
                    continue  # HEAD keeps moto's Content-Length: it is the object's size
                self.send_header(name, value)
            if self.command != "HEAD" and resp.status >= 200 and resp.status not in (204, 304):
                self.send_header("Content-Length", str(len(data)))  # (204 and 304 have none, and no body)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and data:
                self.wfile.write(data)
        finally:
            conn.close()


class S3Server:
    """moto's S3 server (a subprocess) with a fault-injecting proxy in front (threads in this process).

    Use as a context manager: ``__exit__`` stops the proxy, then kills moto's process group and waits for
    it, so nothing outlives the test. `endpoint` is the proxy (give it to the clients under test, or use
    `env()`); `moto_endpoint` and `client()` / `objects()` read moto directly, past any fault."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / "moto.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self.moto_endpoint = ""
        self._log: IO[bytes] | None = None
        self._state: _ProxyState | None = None
        self._proxy: _ProxyServer | None = None
        self._proxy_thread: threading.Thread | None = None
        self._session: Any = None  # one boto3 session for every client (see `client`)
        self._session_lock = threading.Lock()
        self._direct: Any = None

    # --- lifecycle ----------------------------------------------------------------------------------------
    def __enter__(self) -> S3Server:
        try:
            self._start_moto()
            self._start_proxy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._direct is not None:
            self._direct.close()  # its pooled connections to moto
            self._direct = None
        if self._proxy is not None:
            self._proxy.stop()
            self._proxy = None
        if self._proxy_thread is not None:
            self._proxy_thread.join(5)
            self._proxy_thread = None
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: moto and anything it started
            self.process.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def _start_moto(self) -> None:
        """moto.server on a free port, in a new session (so `__exit__` can kill the whole group); waits until
        it answers HTTP. The port is picked, then bound by moto: if another process takes it in between, moto
        dies, and we try another."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in __exit__)
        for _ in range(3):
            port = _free_port()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.moto_endpoint = f"http://127.0.0.1:{port}"
            if self._wait_moto(30.0):
                return
        raise RuntimeError(f"moto.server did not start; {self.log_path}:\n{self._log_tail()}")

    def _wait_moto(self, timeout: float) -> bool:
        """Poll ``GET /`` until moto answers (True), or its process died (False: maybe its port was taken);
        raise if it is alive but silent for `timeout` s. http.client, not urllib: no HTTP proxy from the
        environment in the way."""
        assert self.process is not None
        port = int(self.moto_endpoint.rsplit(":", 1)[1])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            try:
                conn.request("GET", "/")
                conn.getresponse().read()
                return True  # any answer, an error status included: it is up
            except (OSError, http.client.HTTPException):
                time.sleep(0.05)
            finally:
                conn.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        raise RuntimeError(f"moto.server did not answer within {timeout} s; {self.log_path}:\n{self._log_tail()}")

    def _start_proxy(self) -> None:
        port = int(self.moto_endpoint.rsplit(":", 1)[1])
        self._state = _ProxyState(("127.0.0.1", port))
        self._proxy = _ProxyServer(("127.0.0.1", 0), self._state)
        self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self._proxy_thread = threading.Thread(
            target=self._proxy.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="s3-proxy"
        )
        self._proxy_thread.start()

    def _log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    # --- clients ------------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment for a client process: fake credentials, the proxy as its endpoint, no EC2 metadata
        lookup (which would wait on a timeout), and no HTTP proxy for the loopback address."""
        no_proxy = ",".join(x for x in (os.environ.get("NO_PROXY", ""), "127.0.0.1,localhost") if x)
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }

    def client(self, direct: bool = True) -> Any:
        """A new boto3 S3 client with retries off (each fault is seen exactly once): to moto itself by default,
        to the proxy with ``direct=False``. The clients share one boto3 session, which keeps the loaded service
        model: a client from a fresh session costs ~0.3 s of CPU, one more from the same session ~0.02 s."""
        from botocore.config import Config

        with self._session_lock:
            if self._session is None:
                import boto3

                self._session = boto3.session.Session()
            return self._session.client(  # sessions are not thread-safe (clients are): created under the lock
                "s3",
                endpoint_url=self.moto_endpoint if direct else self.endpoint,
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
                region_name="us-east-1",
                config=Config(retries={"total_max_attempts": 1}, connect_timeout=5, read_timeout=60),
            )

    def _moto(self) -> Any:
        """The direct client that `create_bucket` and `objects` share."""
        if self._direct is None:
            self._direct = self.client()
        return self._direct

    def create_bucket(self, name: str) -> None:
        self._moto().create_bucket(Bucket=name)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under `prefix`, key -> bytes, read from moto directly (what really got stored)."""
        c = self._moto()
        out: dict[str, bytes] = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = c.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        return out

    # --- faults -------------------------------------------------------------------------------------------
    @property
    def state(self) -> _ProxyState:
        if self._state is None:
            raise RuntimeError("S3Server is not started (use it as a context manager)")
        return self._state

    def fail_next(self, n: int, status: int = 503, match: str = "") -> None:
        """The next `n` requests whose "METHOD path" contains `match` get an S3 XML error with `status`
        (503: SlowDown, 500: InternalError); they never reach moto. Their body is read first, so the
        connection stays usable."""
        with self.state.lock:
            self.state.faults.append(_Fault("fail", n, match, status))

    def reset_next(self, n: int, match: str = "") -> None:
        """The next `n` matching requests: their headers (and up to 1 KiB of body) are read, then the
        connection is closed with a TCP reset; they never reach moto."""
        with self.state.lock:
            self.state.faults.append(_Fault("reset", n, match))

    def slow_uploads(self, seconds: float, match: str = "") -> None:
        """From now on each matching request with a body takes at least `seconds` to be received (read in
        pieces, with sleeps between) before it is forwarded: a window to act in while it is in flight (find
        it with `wait_in_flight`). A client killed inside the window has its upload dropped, not forwarded,
        even if the kernel had taken all its bytes (counted as "abandoned"). 0 turns it off."""
        with self.state.lock:
            self.state.slow_seconds = float(seconds)
            self.state.slow_match = match

    def clear_faults(self) -> None:
        """No more faults: pending `fail_next` / `reset_next` are dropped and `slow_uploads` is off."""
        with self.state.lock:
            self.state.faults.clear()
            self.state.slow_seconds = 0.0
            self.state.slow_match = ""

    @property
    def counts(self) -> dict[str, int]:
        """A snapshot: "requests" (all), "forwarded" (to moto), "failed" (error replies injected), "reset",
        "slowed" (bodies received slowly), "abandoned" (requests whose client went away before the whole
        body was received, or right after: not forwarded)."""
        with self.state.lock:
            return dict(self.state.counts)

    def in_flight(self) -> list[str]:
        """ "METHOD path" of each request being received or forwarded now."""
        with self.state.lock:
            return list(self.state.in_flight.values())

    def wait_in_flight(self, match: str, timeout: float) -> str:
        """Block until a request whose "METHOD path" contains `match` is in flight; return its "METHOD path".
        Raises TimeoutError (with `describe()`) if none is within `timeout` seconds."""
        state = self.state
        found: list[str] = []

        def seen() -> bool:
            found[:] = [label for label in state.in_flight.values() if match in label][:1]
            return bool(found)

        with state.started:
            if state.started.wait_for(seen, timeout):
                return found[0]
        raise TimeoutError(f"no request matching {match!r} in flight within {timeout} s\n{self.describe()}")

    def describe(self) -> str:
        """Counts, what is in flight and the recent requests (with how each ended): for a failing test."""
        with self.state.lock:
            counts, flying, events = (
                dict(self.state.counts),
                list(self.state.in_flight.values()),
                list(self.state.events),
            )
        lines = [f"S3Server proxy {self.endpoint} -> moto {self.moto_endpoint}; counts {counts}"]
        lines.append(f"in flight: {flying}")
        lines.extend(f"  {e.method} {e.path} -> {e.outcome} ({e.seconds:.3f} s)" for e in events[-60:])
        return "\n".join(lines)
