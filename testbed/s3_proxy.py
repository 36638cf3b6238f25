"""A fault-injecting, recording reverse proxy in front of one S3 (or any HTTP) server on 127.0.0.1.

The tests (``tests/s3_servers.py``, whose docstring lists what it can do) and the benchmarks (bytes a job uploads,
``benchmarks/reuse.py``) put it between a client and a server; it needs nothing but the standard library.
"""

from __future__ import annotations

import http.client
import secrets
import re
import ssl
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
                # the bucket asked again: a straggler that arrived while its test ran may finish after the next
                # test's reset() (seen in CI: a finished test's manifest PUT among the next test's records)
                if ours and (self.bucket is None or bucket == self.bucket):
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
