"""The S3 test server and its fault-injecting proxy (`tests/s3_faults.py`) do what the tests that use it assume.

boto3 clients go through the proxy with retries off, so each injected fault is seen exactly once by the caller.
One moto server serves the module (starting one takes ~1 s); the lifecycle test starts its own.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
from s3_faults import S3Server

# one worker for the whole module under `pytest -n` (--dist loadgroup): one moto server, not one per worker
pytestmark = pytest.mark.xdist_group("s3-faults")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with S3Server(tmp_path_factory.mktemp("s3")) as s3:
        yield s3


@pytest.fixture
def s3(server: S3Server) -> Iterator[S3Server]:
    """The module's server with no faults set. Its event log is printed at teardown: pytest shows that
    output only when the test fails."""
    server.clear_faults()
    yield server
    server.clear_faults()
    print(server.describe())


@pytest.fixture
def bucket(s3: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh bucket per test, named after it."""
    name = request.node.name.replace("_", "-").lower()[:50]
    s3.create_bucket(name)
    return name


def _counts_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_round_trip_through_proxy(s3: S3Server, bucket: str) -> None:
    c = s3.client(direct=False)
    data = bytes(range(256)) * 1000
    c.put_object(Bucket=bucket, Key="dir/a.bin", Body=data)
    assert c.get_object(Bucket=bucket, Key="dir/a.bin")["Body"].read() == data
    assert c.head_object(Bucket=bucket, Key="dir/a.bin")["ContentLength"] == len(data)  # HEAD keeps its length
    listed = c.list_objects_v2(Bucket=bucket, Prefix="dir/")["Contents"]
    assert [(o["Key"], o["Size"]) for o in listed] == [("dir/a.bin", len(data))]

    # multipart: a 5 MiB part (the smallest allowed but for the last) and a 1-byte part
    parts = [b"\x01" * (5 << 20), b"\x02"]
    upload_id = c.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
    etags = [
        c.upload_part(Bucket=bucket, Key="big", UploadId=upload_id, PartNumber=i, Body=p)["ETag"]
        for i, p in enumerate(parts, 1)
    ]
    c.complete_multipart_upload(
        Bucket=bucket,
        Key="big",
        UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": i, "ETag": e} for i, e in enumerate(etags, 1)]},
    )
    assert c.get_object(Bucket=bucket, Key="big")["Body"].read() == b"".join(parts)
    assert s3.objects(bucket) == {"dir/a.bin": data, "big": b"".join(parts)}  # read from moto directly

    c.delete_object(Bucket=bucket, Key="dir/a.bin")
    assert set(s3.objects(bucket)) == {"big"}


def test_chunked_request_body_is_forwarded_with_a_length(s3: S3Server, bucket: str) -> None:
    """aiohttp may send a body of unknown length chunked; moto gets it whole, with a Content-Length."""
    host, port = s3.endpoint.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("PUT", f"/{bucket}/chunked", body=iter([b"abc", b"", b"defgh" * 1000]), encode_chunked=True)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
    finally:
        conn.close()
    assert s3.objects(bucket) == {"chunked": b"abc" + b"defgh" * 1000}


def test_fail_next_replies_slowdown_without_reaching_moto(s3: S3Server, bucket: str) -> None:
    c = s3.client(direct=False)
    before = s3.counts
    s3.fail_next(2, 503, match="PUT")
    for _ in range(2):
        with pytest.raises(botocore.exceptions.ClientError) as info:
            c.put_object(Bucket=bucket, Key="k", Body=b"payload")
        assert info.value.response["Error"]["Code"] == "SlowDown"
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert s3.objects(bucket) == {}  # the failed PUTs never reached moto
    assert _counts_delta(before, s3.counts) == {"requests": 2, "failed": 2}

    c.put_object(Bucket=bucket, Key="k", Body=b"payload")  # the third gets through
    assert s3.objects(bucket) == {"k": b"payload"}
    assert _counts_delta(before, s3.counts) == {"requests": 3, "failed": 2, "forwarded": 1}

    s3.fail_next(1, 500, match="GET")  # a PUT does not match; a GET gets InternalError
    c.put_object(Bucket=bucket, Key="k2", Body=b"x")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        c.get_object(Bucket=bucket, Key="k")
    assert info.value.response["Error"]["Code"] == "InternalError"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"payload"


def test_reset_next_is_a_connection_error(s3: S3Server, bucket: str) -> None:
    c = s3.client(direct=False)
    before = s3.counts
    s3.reset_next(1)
    # a TCP reset before any reply: botocore raises ConnectionClosedError (an HTTPClientError, not a
    # botocore.exceptions.ConnectionError, which is for failures to connect)
    with pytest.raises(botocore.exceptions.ConnectionClosedError):
        c.put_object(Bucket=bucket, Key="k", Body=b"z" * 100_000)
    assert s3.objects(bucket) == {}
    c.put_object(Bucket=bucket, Key="k", Body=b"z" * 100_000)  # the next one succeeds
    assert s3.objects(bucket) == {"k": b"z" * 100_000}
    assert _counts_delta(before, s3.counts) == {"requests": 2, "reset": 1, "forwarded": 1}

    s3.reset_next(1, match="GET")  # a request without a body is reset as well
    with pytest.raises(botocore.exceptions.ConnectionClosedError):
        c.get_object(Bucket=bucket, Key="k")
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"z" * 100_000


def test_slow_upload_is_seen_in_flight(s3: S3Server, bucket: str) -> None:
    c = s3.client(direct=False)
    s3.slow_uploads(0.5, match="PUT")
    result: dict[str, Any] = {}

    def put() -> None:
        t0 = time.monotonic()
        try:
            c.put_object(Bucket=bucket, Key="key", Body=b"s" * 300_000)
        except Exception as e:  # reported below
            result["error"] = e
        result["seconds"] = time.monotonic() - t0

    before = s3.counts
    t = threading.Thread(target=put)
    t.start()
    try:
        seen = s3.wait_in_flight(f"PUT /{bucket}/key", 5)
        assert seen == f"PUT /{bucket}/key"
        assert seen in s3.in_flight()
    finally:
        t.join(10)
    assert "error" not in result, result
    assert result["seconds"] >= 0.5
    assert s3.in_flight() == []
    assert s3.objects(bucket) == {"key": b"s" * 300_000}
    assert _counts_delta(before, s3.counts) == {"requests": 1, "slowed": 1, "forwarded": 1}

    c.get_object(Bucket=bucket, Key="key")  # a GET is not slowed
    s3.slow_uploads(0)
    t0 = time.monotonic()
    c.put_object(Bucket=bucket, Key="fast", Body=b"f")
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(TimeoutError):
        s3.wait_in_flight("PUT", 0.05)


def _wait_idle(s3: S3Server, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while s3.in_flight() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s3.in_flight() == []


def test_client_gone_mid_upload_is_not_forwarded(s3: S3Server, bucket: str) -> None:
    """A client that dies inside the slow window never gets its object stored: whether its body was cut short,
    or had all reached the proxy (kernel socket buffers take a small body at once) before it died."""
    s3.slow_uploads(0.3, match="PUT")
    host, port = s3.endpoint.removeprefix("http://").split(":")
    for key, sent in [("whole", 1000), ("cut", 10)]:
        before = s3.counts
        sock = socket.create_connection((host, int(port)), timeout=5)
        head = f"PUT /{bucket}/{key} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 1000\r\n\r\n"
        sock.sendall(head.encode() + b"g" * sent)
        assert s3.wait_in_flight(f"PUT /{bucket}/{key}", 5) == f"PUT /{bucket}/{key}"
        sock.close()  # the client dies mid-upload
        _wait_idle(s3)
        assert s3.objects(bucket) == {}
        expected = {"requests": 1, "abandoned": 1} | ({"slowed": 1} if sent == 1000 else {})
        assert _counts_delta(before, s3.counts) == expected


def test_s3fs_through_proxy(s3: S3Server, bucket: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": s3.endpoint}, key="testing", secret="testing", skip_instance_cache=True
    )
    data = b"s3fs payload\n" * 1000
    with fs.open(f"{bucket}/dir/file.txt", "wb") as f:
        f.write(data)
    assert fs.cat(f"{bucket}/dir/file.txt") == data
    assert fs.ls(f"{bucket}/dir", detail=False) == [f"{bucket}/dir/file.txt"]
    assert s3.objects(bucket) == {"dir/file.txt": data}
    before = s3.counts["forwarded"]
    fs.cat(f"{bucket}/dir/file.txt")
    assert s3.counts["forwarded"] > before  # it really went through the proxy


def _refused(endpoint: str) -> bool:
    host, port = endpoint.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_everything_ends_with_the_block(tmp_path: Path) -> None:
    with S3Server(tmp_path) as s3:
        assert s3.env()["AWS_ENDPOINT_URL"] == s3.endpoint
        s3.create_bucket("lifecycle")
        c = s3.client(direct=False)
        c.put_object(Bucket="lifecycle", Key="k", Body=b"v")  # leaves a keep-alive connection in c's pool
        process = s3.process
        assert process is not None and process.poll() is None
    assert process.poll() is not None
    assert _refused(s3.endpoint)
    assert _refused(s3.moto_endpoint)
    # the pooled keep-alive connection was ended too: the client cannot reach anything
    with pytest.raises((botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        c.get_object(Bucket="lifecycle", Key="k")
    assert (tmp_path / "moto.log").exists()
