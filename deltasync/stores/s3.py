"""S3 and S3-compatible object stores (``s3://bucket/prefix``).

Client: obstore (Rust ``object_store``): async-capable, built-in retries with capped
backoff, conditional puts (``mode="create"``, ``mode={"e_tag": ...}``) and range
gets; the same client talks to AWS, Hugging Face's S3 gateway, R2 and MinIO.

Configuration comes from keyword options first, then the usual AWS environment
variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``, ...), then obstore's
credential chain (web identity, ECS/EKS, instance metadata).

Limitations:

- Retries are obstore's: 5xx answers and connection errors are retried for every
  request, timeouts only for safe ones; 429 is not retried and ``Retry-After`` is
  not read. A conditional put whose first attempt committed but whose answer was
  lost (a 5xx after the write) is retried and then reports
  :class:`~deltasync.errors.PreconditionFailed` although this writer won; callers
  that must know read the object back.
- Conditional puts are single requests (S3 caps those at 5 GB); unconditional puts
  of large objects go multipart, which is still atomic for readers.
- ``delete`` uses the bulk DeleteObjects API; stores without it need
  ``AWS_DISABLE_BULK_DELETE=true`` in the environment.
- Errors never chain the client's exception: its text can carry the access key id
  echoed by the server, so messages are rebuilt and redacted.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import ConfigError, DeltaSyncError, ObjectNotFound, PreconditionFailed, StoreError, require
from .base import (
    RETRY_ATTEMPTS,
    RETRY_BASE_DELAY,
    RETRY_MAX_DELAY,
    ObjectInfo,
    PutMode,
    Store,
    check_key,
    check_limit,
    check_prefix,
    check_size,
)

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

__all__ = ["S3Store"]

T = TypeVar("T")

# Retry policy handed to obstore, the numbers of base.retry (after huggingface_hub's
# http_backoff): up to 4 retries, 0.25 s doubling to at most 8 s, and a 2-minute
# budget, well below the 5 minutes a SigV4 signature stays valid.
RETRY_TIMEOUT = timedelta(minutes=2)
_DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": RETRY_ATTEMPTS - 1,
    "backoff": {
        "init_backoff": timedelta(seconds=RETRY_BASE_DELAY),
        "max_backoff": timedelta(seconds=RETRY_MAX_DELAY),
        "base": 2,
    },
    "retry_timeout": RETRY_TIMEOUT,
}

# Network timeouts handed to obstore unless ``client_options`` sets its own: obstore's (object_store's)
# documented defaults, pinned here so no request can wait forever whatever a future default becomes.
# The whole-request limit also bounds a stalled body; objects too large to move in it over a slow
# link need a larger ``client_options={"timeout": ...}``.
CONNECT_TIMEOUT = timedelta(seconds=5)
REQUEST_TIMEOUT = timedelta(seconds=30)

# obstore reads client options from ``AWS_<OPTION>`` variables only when no ``client_options`` are
# passed; the timeouts above always are, so these are read from the environment here instead
# (the keys of obstore's ``ClientConfig`` that take a single value).
_CLIENT_ENV_KEYS = (
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type", "http1_only",
    "http2_keep_alive_interval", "http2_keep_alive_timeout", "http2_keep_alive_while_idle", "http2_only",
    "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate", "proxy_excludes",
    "root_certificate", "randomize_addresses", "read_timeout", "timeout", "user_agent",
)  # fmt: skip

# Error text longer than this is cut: S3 error bodies are XML and can be long.
_MAX_MESSAGE = 600

# S3 bucket names are 3-63 lowercase characters; S3-compatible gateways (HF's uses
# the namespace as bucket) also take uppercase, so only the character set is checked.
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

# Where the AWS credential chain ends when nothing else provided credentials: the instance metadata service.
_METADATA_ENDPOINT = "169.254.169.254"
# Environment variables whose values must never appear in messages.
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_TOKEN")

# Credential-bearing fields AWS echoes in error bodies (InvalidAccessKeyId,
# SignatureDoesNotMatch) and in presigned query strings.
_SECRET_PATTERNS = (
    (
        re.compile(
            r"(<(AWSAccessKeyId|StringToSign|StringToSignBytes|CanonicalRequest|CanonicalRequestBytes"
            r"|SignatureProvided)>).*?(</\2>)",
            re.S,
        ),
        r"\1***\3",
    ),
    (re.compile(r"((?:X-Amz-)?(?:Credential|Security-Token|Signature)=)[^&\s,\"'<]+", re.I), r"\1***"),
)

_TRUE = {"1", "true", "yes", "on"}


class S3Store(Store):
    """Objects in an S3 (or S3-compatible) bucket, under an optional key prefix.

    Args:
        bucket (`str`):
            The bucket name.
        prefix (`str`, *optional*, defaults to `""`):
            Key prefix every key is joined under (``/``-separated, no leading slash).
        endpoint (`str`, *optional*):
            Service URL, e.g. ``"https://s3.hf.co/my-namespace"`` or ``"http://127.0.0.1:9000"``.
            Defaults to ``AWS_ENDPOINT_URL`` or the AWS regional endpoint.
        region (`str`, *optional*):
            Signing region. Defaults to ``AWS_REGION`` or ``us-east-1``.
        access_key_id (`str`, *optional*):
            Access key id; pass it together with ``secret_access_key``.
        secret_access_key (`str`, *optional*):
            Secret access key.
        session_token (`str`, *optional*):
            Session token of temporary credentials.
        allow_http (`bool`, *optional*):
            Allow a plain ``http://`` endpoint (local servers). Defaults to ``AWS_ALLOW_HTTP``.
        virtual_hosted_style_request (`bool`, *optional*):
            Address the bucket as ``bucket.endpoint`` instead of ``endpoint/bucket``.
        client_options (`dict`, *optional*):
            obstore ``ClientConfig`` (timeouts, proxies, ...), laid over this module's timeouts
            (:data:`CONNECT_TIMEOUT`, :data:`REQUEST_TIMEOUT`).
        retry_config (`dict`, *optional*):
            obstore ``RetryConfig``, laid over this module's defaults.

    Raises:
        `ConfigError`: an invalid bucket, prefix or option combination.
        `MissingDependency`: obstore is not installed (``pip install 'deltasync[s3]'``).

    Example:
        ```py
        >>> store = open_store("s3://my-bucket/runs/exp1", endpoint="https://s3.hf.co/my-namespace")
        >>> store.put("manifest.json", b"{}", mode="create")
        ```
    """

    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        allow_http: bool | None = None,
        virtual_hosted_style_request: bool | None = None,
        client_options: ClientConfig | None = None,
        retry_config: RetryConfig | None = None,
    ) -> None:
        bucket, prefix = _check_location(bucket, prefix)
        super().__init__(f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")
        self.bucket = bucket
        self.prefix = prefix
        if (access_key_id is None) != (secret_access_key is None):
            raise ConfigError(
                "pass access_key_id and secret_access_key together (or neither, to use the environment)",
                argument="access_key_id",
            )
        secrets = [access_key_id, secret_access_key, session_token, *(os.environ.get(v) for v in _SECRET_ENV)]
        self._secrets = tuple(sorted({s for s in secrets if s}, key=len, reverse=True))

        config: dict[str, Any] = {}
        if endpoint is not None:
            # AWS_ENDPOINT_URL_S3 would otherwise win over an explicit endpoint.
            config["endpoint"] = config["aws_endpoint_url_s3"] = endpoint.rstrip("/")
        for name, value in (
            ("region", region),
            ("access_key_id", access_key_id),
            ("secret_access_key", secret_access_key),
            ("session_token", session_token),
            ("virtual_hosted_style_request", virtual_hosted_style_request),
        ):
            if value is not None:
                config[name] = value
        client: dict[str, Any] = {
            "connect_timeout": CONNECT_TIMEOUT,
            "timeout": REQUEST_TIMEOUT,
            **_client_env(),
            **(client_options or {}),
        }
        if allow_http is not None:
            client["allow_http"] = allow_http
        _check_http(config.get("endpoint"), client)

        retry = {**_DEFAULT_RETRY, **(retry_config or {})}
        self._store: Any = _build_client(bucket, prefix, config, client, retry, self._redact, self.url)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Store:
        """Open ``s3://bucket`` or ``s3://bucket/some/prefix``.

        Args:
            url (`str`): the store URL.
            **options: the keyword arguments of :class:`S3Store` (``endpoint``, ``region``,
                credentials, ``allow_http``, ...).

        Raises:
            `ConfigError`: the URL is not ``s3://bucket[/prefix]``.
        """
        if not isinstance(url, str) or not url.startswith("s3://"):
            raise ConfigError(f"not an S3 URL: {_safe_url(url)!r}; expected 's3://bucket/prefix'", argument="url")
        rest = url[len("s3://") :]
        if any(c in rest for c in "?#"):
            raise ConfigError(
                f"S3 URL {_safe_url(url)!r} has a query or fragment; expected 's3://bucket/prefix'", argument="url"
            )
        bucket, _, prefix = rest.partition("/")
        if "@" in bucket:
            raise ConfigError(
                "S3 URLs must not carry credentials ('s3://user:secret@bucket'); "
                "pass access_key_id/secret_access_key or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
                argument="url",
            )
        return cls(bucket, prefix, **options)

    # -- operations ---------------------------------------------------------------------

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        check_key(key)
        if mode not in ("overwrite", "create"):
            raise ValueError(f"put mode must be 'overwrite' or 'create', not {mode!r}")
        if mode == "create" and if_match is not None:
            raise ValueError("put(mode='create') and if_match exclude each other: a created key has no etag yet")
        obs = _obstore()
        conditional = mode == "create" or if_match is not None
        put_mode: Any = {"e_tag": if_match} if if_match is not None else mode
        # Conditional writes must be one request: the precondition is checked on it.
        result = self._call(
            "put",
            key,
            lambda: obs.put(self._store, key, data, mode=put_mode, use_multipart=False if conditional else None),
        )
        return ObjectInfo(key, len(data), result.get("e_tag"), None)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Read ``key``; an object larger than ``max_bytes`` is refused from the response headers,
        before its body is read."""
        check_key(key)
        check_limit(max_bytes)
        obs = _obstore()
        return self._call("get", key, lambda: self._body(key, obs.get(self._store, key), max_bytes))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_key(key)
        if start < 0 or end < 0:
            raise ValueError(f"byte range [{start}, {end}) must not be negative")
        obs = _obstore()
        if end <= start:  # obstore refuses empty ranges; slicing semantics give b""
            self.head(key)
            return b""
        try:
            return self._call("get_range", key, lambda: bytes(obs.get_range(self._store, key, start=start, end=end)))
        except ObjectNotFound:
            raise
        except StoreError:
            # S3 answers 416 for a range starting past the end; slicing gives b"".
            if start >= self.head(key).size:
                return b""
            raise

    def head(self, key: str) -> ObjectInfo:
        check_key(key)
        obs = _obstore()
        return _info(key, self._call("head", key, lambda: obs.head(self._store, key)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # obstore lists whole path segments; list the enclosing "directory" and
        # filter by string prefix, which is what the protocol promises.
        directory = prefix.rpartition("/")[0]
        if directory:
            check_key(directory)
        obs = _obstore()
        stream = self._call("list", prefix, lambda: obs.list(self._store, directory or None, chunk_size=1000))
        batches = iter(stream)
        while True:
            batch = self._call("list", prefix, lambda: next(batches, None))
            if batch is None:
                return
            for meta in batch:
                if meta["path"].startswith(prefix):
                    yield _info(meta["path"], meta)

    def delete(self, key: str) -> None:
        check_key(key)
        obs = _obstore()
        with contextlib.suppress(ObjectNotFound):  # some S3-compatible stores 404 a missing key
            self._call("delete", key, lambda: obs.delete(self._store, key))

    def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, ObjectInfo] | None:
        """Read ``key`` unless its etag still equals ``etag``: a conditional GET (304, no body).

        An object larger than ``max_bytes`` is refused before its body is read, as for :meth:`get`.
        """
        check_key(key)
        check_limit(max_bytes)
        obs = _obstore()
        exceptions = require("obstore.exceptions", "s3")
        options: dict[str, Any] = {} if etag is None else {"if_none_match": etag}

        def fetch() -> tuple[bytes, ObjectInfo] | None:
            try:
                result = obs.get(self._store, key, options=options)
            except exceptions.NotModifiedError:
                return None
            return self._body(key, result, max_bytes), _info(key, result.meta)

        return self._call("get", key, fetch)

    def _body(self, key: str, result: Any, max_bytes: int | None) -> bytes:
        """The body of a GET, refused unread when the response's size exceeds ``max_bytes``."""
        check_size(key, int(result.meta["size"]), max_bytes, where=self.url, backend="s3")
        data = bytes(result.bytes())
        check_size(key, len(data), max_bytes, where=self.url, backend="s3")  # a body longer than declared
        return data

    # -- error translation --------------------------------------------------------------

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run one client call, translating its errors into deltasync's tree.

        The translated error is raised outside the ``except`` block so neither
        ``__cause__`` nor ``__context__`` keeps the client's unredacted message.
        """
        try:
            return fn()
        except DeltaSyncError:
            raise
        except Exception as exc:  # any client failure, translated below
            error = self._translate(op, key, exc)
        raise error

    def _translate(self, op: str, key: str, exc: Exception) -> StoreError:
        exceptions = require("obstore.exceptions", "s3")
        detail = self._redact(_first_part(str(exc)))
        where = f"{key!r} in {self.url}"
        if isinstance(exc, exceptions.AlreadyExistsError):
            return PreconditionFailed(f"{key!r} already exists in {self.url}", key=key, backend="s3")
        if isinstance(exc, exceptions.PreconditionError):
            return PreconditionFailed(f"{key!r} changed since it was read ({self.url})", key=key, backend="s3")
        if isinstance(exc, FileNotFoundError):
            if op in ("put", "list"):  # a write or listing 404s only when the bucket is missing
                return StoreError(
                    f"{op} {where} failed: bucket {self.bucket!r} not found ({detail})", key=key, backend="s3"
                )
            return ObjectNotFound(f"no object {where}", key=key, backend="s3")
        kind = type(exc).__name__
        if _METADATA_ENDPOINT in detail or "/latest/api/token" in detail:  # the chain found no credentials
            return StoreError(
                f"{op} {where} failed: no S3 credentials found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(and AWS_ENDPOINT_URL for a server other than AWS), pass access_key_id= / secret_access_key= to "
                "the store, or run where an instance or pod role provides them. (The last source tried, the "
                f"instance metadata service, answered: {detail[:200]})",
                key=key, backend="s3",
            )
        return StoreError(f"{op} {where} failed: {kind}: {detail}", key=key, backend="s3")

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        for pattern, replacement in _SECRET_PATTERNS:
            text = pattern.sub(replacement, text)
        return text

    def close(self) -> None:
        """Nothing to release: obstore pools connections per client and drops them with it."""


def _build_client(
    bucket: str,
    prefix: str,
    config: dict[str, Any],
    client: dict[str, Any],
    retry: dict[str, Any],
    redact: Callable[[str], str],
    url: str,
) -> Any:
    """The obstore client; its constructor also reads ``AWS_*`` variables for what is unset."""
    obstore_store = require("obstore.store", "s3")
    try:
        return obstore_store.S3Store(
            bucket, prefix=prefix or None, config=config, client_options=client, retry_config=retry
        )
    except Exception as exc:  # rebuilt below, without the unredacted cause
        message = f"cannot configure {url}: {redact(_first_part(str(exc)))}"
    raise ConfigError(message, argument="client_options")


def _client_env() -> dict[str, str]:
    """Client options set as ``AWS_<OPTION>`` environment variables (see :data:`_CLIENT_ENV_KEYS`)."""
    return {key: os.environ[f"AWS_{key.upper()}"] for key in _CLIENT_ENV_KEYS if os.environ.get(f"AWS_{key.upper()}")}


def _obstore() -> Any:
    return require("obstore", "s3")


def _info(key: str, meta: Any) -> ObjectInfo:
    modified = meta.get("last_modified")
    return ObjectInfo(key, int(meta["size"]), meta.get("e_tag"), modified.timestamp() if modified else None)


def _first_part(message: str) -> str:
    """The human part of an obstore message, without its multi-line Rust debug dump."""
    message = message.split("\n\nDebug source:", 1)[0]
    message = " ".join(message.split())
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."


def _check_location(bucket: str, prefix: str) -> tuple[str, str]:
    if not bucket:
        raise ConfigError("S3 URL has no bucket; expected 's3://bucket' or 's3://bucket/prefix'", argument="bucket")
    if not _BUCKET.match(bucket) or len(bucket) > 255:
        raise ConfigError(
            f"invalid S3 bucket name {bucket!r}: use letters, digits, '.', '-' and '_' "
            "(AWS: 3-63 lowercase characters); expected 's3://bucket/prefix'",
            argument="bucket",
        )
    prefix = check_prefix(
        prefix,
        invalid=lambda bad: ConfigError(
            f"invalid S3 prefix {bad!r}: use '/'-separated segments of [A-Za-z0-9._=+@,-], "
            "no empty, '.' or '..' segments",
            argument="prefix",
        ),
    )
    return bucket, prefix


def _check_http(endpoint: str | None, client: dict[str, Any]) -> None:
    """Refuse a plain-http endpoint without ``allow_http`` up front (obstore says only 'builder error')."""
    endpoint = endpoint or next(
        (os.environ[v] for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT") if os.environ.get(v)), None
    )
    if not endpoint or not endpoint.lower().startswith("http://"):
        return
    allowed = client.get("allow_http")
    if allowed is None:
        allowed = os.environ.get("AWS_ALLOW_HTTP", "").strip().lower() in _TRUE
    if not _truthy(allowed):
        raise ConfigError(
            f"endpoint {_safe_url(endpoint)!r} is plain http: pass allow_http=True (or set AWS_ALLOW_HTTP=true)",
            argument="endpoint",
        )


def _truthy(value: object) -> bool:
    return value.strip().lower() in _TRUE if isinstance(value, str) else bool(value)


def _safe_url(url: object) -> str:
    """A URL for messages, with any ``user:password@`` part removed."""
    return re.sub(r"(://)[^/@]*@", r"\1***@", str(url))
