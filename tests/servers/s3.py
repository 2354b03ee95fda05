"""A real S3 endpoint on loopback: moto's threaded server, for the S3 backend's tests.

``serve()`` starts ``ThreadedMotoServer`` on 127.0.0.1 with an OS-chosen port,
creates a fresh bucket over HTTP and yields an :class:`S3Server` that tells
stores how to reach it. Nothing is written to ``os.environ``: credentials and
endpoint travel as store options.

moto keeps its state in process-wide backends, so two servers in one process
share buckets (hence a unique bucket name per server), and anything calling
moto's reset (``mock_aws`` in another test) empties them.
"""

from __future__ import annotations

import contextlib
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Dummy credentials: moto accepts any, and tests look for these strings in messages.
ACCESS_KEY_ID = "AKIADELTASYNCTEST0001"
SECRET_ACCESS_KEY = "deltasync-test-secret-do-not-print"
REGION = "us-east-1"


@dataclass
class S3Server:
    """A running loopback S3 server and the bucket made for this session."""

    host: str
    """Loopback address the server listens on."""
    port: int
    """Port the OS picked."""
    bucket: str
    """Bucket created at start."""
    region: str = REGION
    """Region stores sign for (moto accepts any)."""
    access_key_id: str = ACCESS_KEY_ID
    """Dummy access key id."""
    secret_access_key: str = SECRET_ACCESS_KEY
    """Dummy secret key."""
    server: Any = field(default=None, repr=False)
    """The ``ThreadedMotoServer`` itself, for fault-injection tests."""

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    def store_url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>`` (``s3://<bucket>`` for the bucket root)."""
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def store_options(self, **overrides: Any) -> dict[str, Any]:
        """Options for ``open_store(self.store_url(p), **options)``; ``overrides`` replace entries."""
        options: dict[str, Any] = {
            "endpoint": self.endpoint,
            "allow_http": True,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "region": self.region,
        }
        options.update(overrides)
        return options

    def create_bucket(self, name: str | None = None) -> str:
        """Create another bucket (moto takes unsigned requests) and return its name."""
        name = name or f"deltasync-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        # No proxies: a proxy from the environment must never see loopback traffic.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=10) as response:
            response.read()
        return name


@contextlib.contextmanager
def serve() -> Iterator[S3Server]:
    """Start moto on 127.0.0.1, create a bucket, yield the server, stop it on exit."""
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        server = S3Server(host=host, port=port, bucket="", server=moto)
        server.bucket = server.create_bucket()
        yield server
    finally:
        moto.stop()
