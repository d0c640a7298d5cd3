"""`s3://bucket/prefix` store on boto3: AWS, Ceph RGW, MinIO, and OpenStack Swift's s3api.

Only dlstore's retry policy retries; botocore makes one attempt per call. So an auth failure
comes back at once, and `storage.retry` retries a transient one with backoff and a deadline.

`ensure_container()` creates a missing bucket when the credentials may. A plain put into a
missing bucket is `NotFound`, with the command that creates it.

    >>> store = S3Store("s3://datasets/imagenet", StoreConfig(s3=S3Config(endpoint_url="http://127.0.0.1:8080")))
    >>> store.put("train/shard-000000.tar", "/data/shard-000000.tar")   # doctest: +SKIP
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

import boto3
import botocore.config
import botocore.exceptions
import urllib3.exceptions

from dlstore.config import S3Config, StoreConfig
from dlstore.errors import AuthError, ConfigError, DlstoreError, NotFound, ObjectChanged, TransientError
from dlstore.storage.base import (
    ObjectInfo,
    ReadPin,
    Store,
    answered_range,
    connection_failure,
    grown_part_size,
    read_block,
    remaining_size,
    skip_prefix,
    split_bucket_url,
    unknown_host,
)
from dlstore.storage.retry import call_with_retry
from dlstore.storage.stall import ConnectionRegistry, ProgressBody, watched_pools

__all__ = ["S3Store", "make_s3_client"]

log = logging.getLogger(__name__)

_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchUpload"}
_AUTH_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "403",
    "401",
}
_TRANSIENT_CODES = {
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "503",
    "500",
}
# Failures of the connection itself, including a body cut off mid-stream: a short read.
_TRANSIENT_EXCEPTIONS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ResponseStreamingError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    ConnectionError,
    TimeoutError,
)
# Multipart uploads: parts of 5 MiB to 5 GiB, the last may be smaller. At most 1,000 of them,
# Swift s3api's `max_upload_part_num` default, where AWS, Ceph and MinIO take 10,000.
_MIN_PART = 5 * 2**20
_MAX_PART = 5 * 2**30
_MAX_PARTS = 1000
# boto3 sessions are not thread-safe to create clients from; one lock for all stores.
_client_creation_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    # A thread of the parent may have held the lock at fork time; the child has no such thread.
    global _client_creation_lock
    _client_creation_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


def _add_content_md5(request: Any, **_: Any) -> None:
    """DeleteObjects needs Content-MD5 on Swift s3api 2.30.
    boto3 >= 1.36 sends a CRC32 instead, even with `when_required`."""
    body = request.body or b""
    body = body.encode() if isinstance(body, str) else body
    request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()


def _botocore_config(options: dict[str, Any]) -> botocore.config.Config:
    """botocore's Config for `options`. The checksum options need botocore 1.36.
    An older botocore raises a bare TypeError for them, which says nothing about the version."""
    try:
        return botocore.config.Config(**options)
    except TypeError as exc:
        raise ConfigError(
            f"botocore {botocore.__version__} is too old ({exc}): dlstore needs boto3 and botocore >= 1.36, "
            "e.g. pip install 'boto3>=1.36'"
        ) from None


#: The calls `Store._answer_watched` cuts when their answer stalls. An upload's wait restarts
#: at each block of its body sent. Completing a multipart upload is not watched: it may work
#: through its parts for minutes before it answers, and AWS sends whitespace meanwhile.
_UPLOADS = frozenset({"put_object", "upload_part"})
_AWAITED = frozenset({"head_object", "head_bucket", "create_multipart_upload", "delete_object"}) | _UPLOADS


def _watch_connections(client: Any, registry: ConnectionRegistry) -> None:
    """Make botocore's HTTP pools note in `registry` which connection each thread sends on."""
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    manager = getattr(session, "_manager", None)
    if manager is None or not hasattr(session, "_pool_classes_by_scheme"):
        return
    pools = watched_pools(session._pool_classes_by_scheme, registry)
    session._pool_classes_by_scheme = manager.pool_classes_by_scheme = pools


def make_s3_client(config: S3Config, connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0) -> Any:
    """A boto3 S3 client for `config`, with botocore's retries off and path-style addressing.

    >>> client = make_s3_client(S3Config(endpoint_url="http://127.0.0.1:8080"))   # doctest: +SKIP
    """
    options: dict[str, Any] = dict(
        s3={"addressing_style": config.addressing_style},
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        max_pool_connections=32,
    )
    if config.checksum_when_required:
        options["request_checksum_calculation"] = "when_required"
        options["response_checksum_validation"] = "when_required"
    client_config = _botocore_config(options)
    try:
        with _client_creation_lock:
            session = boto3.session.Session(
                profile_name=config.profile,
                aws_access_key_id=config.access_key_id,
                aws_secret_access_key=config.secret_access_key.reveal() if config.secret_access_key else None,
                aws_session_token=config.session_token.reveal() if config.session_token else None,
                region_name=config.region,
            )
            client = session.client(
                "s3",
                endpoint_url=config.endpoint_url,
                verify=config.ca_bundle if config.ca_bundle else None,
                config=client_config,
            )
    except botocore.exceptions.ProfileNotFound:
        raise ConfigError(f"AWS profile {config.profile!r} is not in the AWS config files") from None
    except ValueError as exc:  # e.g. a malformed endpoint URL
        raise ConfigError(f"cannot build an S3 client: {exc}") from None
    client.meta.events.register("before-sign.s3.DeleteObjects", _add_content_md5)
    return client


_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def _bucket_name_fault(what: str) -> str | None:
    """What S3's naming rules find wrong with the bucket of the `s3://` URL `what`, if anything.
    A refused name gets a bare "400 Bad Request" to a HEAD, whose answer has no body."""
    if not what.startswith("s3://"):
        return None
    name = what[len("s3://") :].split("/", 1)[0]
    if not _BUCKET_NAME.fullmatch(name):
        return (
            "must have 3 to 63 characters: lowercase letters, digits, dots and hyphens, a letter or digit at each end"
        )
    if ".." in name or ".-" in name or "-." in name or re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        return "must not have a dot beside a dot or a hyphen, nor be an IP address"
    return None


def _map_error(exc: BaseException, what: str) -> DlstoreError:
    """Our error for a boto3, botocore or urllib3 exception. Messages carry the object URL,
    the S3 error code and message, never a credential; `str(ClientError)` holds none."""
    if isinstance(exc, DlstoreError):
        return exc
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        text = f"{what}: {code or status} {error.get('Message') or ''}".rstrip()
        if code in _NOT_FOUND_CODES or status == 404:
            return NotFound(text)
        if code in _AUTH_CODES or status in (401, 403):
            return AuthError(text)
        if code in _TRANSIENT_CODES or status in (408, 429) or status >= 500:
            return TransientError(text)
        if status == 400 and code in ("400", "InvalidBucketName") and (fault := _bucket_name_fault(what)):
            # A HEAD's bare 400 has no reason. Stores that allow other names, as Ceph and Swift
            # can, refuse a HEAD for other reasons too.
            likely = "breaks" if code == "InvalidBucketName" else "may be the cause: it breaks"
            return ConfigError(f"{text}: the bucket's name {likely} S3's naming rules (a bucket name {fault})")
        return DlstoreError(text)
    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
        return AuthError(f"{what}: no usable S3 credentials ({type(exc).__name__})")
    if isinstance(exc, botocore.exceptions.SSLError):
        return DlstoreError(f"{what}: TLS failure (check AWS_CA_BUNDLE): {type(exc).__name__}")
    if unknown_host(exc):
        return ConfigError(f"{what}: no such host{connection_failure(exc)}; check the endpoint URL")
    if isinstance(exc, _TRANSIENT_EXCEPTIONS):
        return TransientError(f"{what}: {type(exc).__name__}{connection_failure(exc)}")
    if isinstance(exc, botocore.exceptions.BotoCoreError):
        return DlstoreError(f"{what}: {type(exc).__name__}: {exc}")
    return DlstoreError(f"{what}: {type(exc).__name__}")


class S3Store(Store):
    """Objects in one bucket under a key prefix; large puts go as multipart uploads.

    >>> store = S3Store("s3://bucket/train")      # endpoint and keys from the environment
    >>> store.url
    's3://bucket/train'
    """

    scheme = "s3"

    def __init__(self, url: str, config: StoreConfig | None = None) -> None:
        self.bucket, self.prefix, canonical = split_bucket_url(url, "s3", "bucket")
        super().__init__(canonical, config)
        # `Store.__getstate__` drops attributes named `_client*` when pickled.
        self._client: Any = None
        self._client_pid = 0

    @property
    def client(self) -> Any:
        """The boto3 client, made on first use and again in a forked or unpickled process."""
        client = getattr(self, "_client", None)
        if client is None or getattr(self, "_client_pid", 0) != os.getpid():
            retry = self.config.retry
            client = make_s3_client(self.config.s3, retry.connect_timeout_s, retry.read_timeout_s)
            _watch_connections(client, self._connections())
            self._client, self._client_pid = client, os.getpid()
        return client

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        # A call that only waits for an answer, not an upload, is cut if the answer stalls.
        watched = self._answer_watched(what) if method in _AWAITED else contextlib.nullcontext()
        with watched as read:
            if method in _UPLOADS:  # its wait restarts at each block sent
                body = kwargs["Body"]
                kwargs["Body"] = ProgressBody(io.BytesIO(body) if isinstance(body, bytes) else body, read)
            try:
                return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
            except Exception as exc:
                raise _map_error(exc, what) from None

    # -- listing ----------------------------------------------------------------------
    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        # list_objects_v2 by hand rather than through the paginator, so that each page is
        # retried on its own and a failure on page 9 does not restart from page 1.
        full_prefix = self._name(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": full_prefix, "MaxKeys": self.config.s3.list_page_size}
            if token:
                kwargs["ContinuationToken"] = token
            page = call_with_retry(self.config.retry, lambda kw=kwargs: self._list_page(kw))
            for item in page.get("Contents", ()):
                yield ObjectInfo(
                    key=item["Key"][strip:],
                    size=item["Size"],
                    etag=item.get("ETag", "").strip('"') or None,
                    mtime=item["LastModified"].timestamp() if item.get("LastModified") else None,
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _list_page(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            with self._answer_watched(self.url):
                return self.client.list_objects_v2(Bucket=self.bucket, **kwargs)
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            if error.get("Code") == "InternalError" and "412" in str(error.get("Message")):
                # Swift's s3api asked the cluster for more names than its container_listing_limit.
                raise ConfigError(
                    f"{self.url}: the cluster lists fewer than {kwargs['MaxKeys'] + 1} names per request; "
                    "set DLSTORE_S3_LIST_PAGE_SIZE below its container_listing_limit"
                ) from None
            raise _map_error(exc, self.url) from None
        except Exception as exc:
            raise _map_error(exc, self.url) from None

    def _stat(self, key: str) -> ObjectInfo:
        head = self._call(self.join(key), "head_object", Key=self._name(key))
        modified = head.get("LastModified")
        return ObjectInfo(
            key=key,
            size=head["ContentLength"],
            etag=head.get("ETag", "").strip('"') or None,
            mtime=modified.timestamp() if modified else None,
        )

    # -- reading ----------------------------------------------------------------------
    reads_versions = True

    def _read(self, key: str, start: int, end: int | None, pin: ReadPin | None = None) -> Iterator[bytes]:
        what = self.join(key)
        kwargs: dict[str, Any] = {"Key": self._name(key)}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if pin is not None and pin.etag:
            kwargs["IfMatch"] = pin.etag  # a resume: the version read so far, or 412
        try:
            with self._answer_watched(what):
                response = self.client.get_object(Bucket=self.bucket, **kwargs)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            # 416: the range starts at or past the end, or the object is empty: no bytes.
            if code == "InvalidRange":
                return
            if code == "PreconditionFailed" and "IfMatch" in kwargs:
                raise ObjectChanged(f"{what}: the object was replaced while it was read") from None
            raise _map_error(exc, what) from None
        except Exception as exc:
            raise _map_error(exc, what) from None
        body = response["Body"]
        expected = response.get("ContentLength")
        try:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 200)
            skip, size = answered_range(what, start, end, status, response.get("ContentRange"), expected)
        except DlstoreError:
            body.close()
            raise
        if pin is not None:
            pin.note(response.get("ETag"), size)
        received = 0
        chunk_size = self.config.chunk_size
        # The watch's thread cuts a trickling server with urllib3's `HTTPResponse.shutdown`.
        # botocore's StreamingBody keeps that response in `_raw_stream`; else it is closed.
        read = self._stall_watch().watch(getattr(getattr(body, "_raw_stream", None), "shutdown", body.close))
        try:
            # Body.read(n) hands back urllib3's own bytes object: no copy here, no hashing.
            while True:
                with read.waiting():
                    chunk = body.read(chunk_size)
                if not chunk:
                    break
                received += len(chunk)
                if skip:  # the whole object came: its bytes before `start` are not the range's
                    chunk, skip = skip_prefix(chunk, skip)
                    if not chunk:
                        continue
                yield chunk
        except Exception as exc:
            raise self._stalled(what) if read.cut else _map_error(exc, what) from None
        finally:
            read.done()
            body.close()
        if expected is not None and received != expected:
            if read.cut:
                raise self._stalled(what)
            raise TransientError(f"short read of {what}: {received} of {expected} bytes")

    # -- buckets ----------------------------------------------------------------------
    def _make_bucket_command(self) -> str:
        endpoint = self.config.s3.endpoint_url
        return f"aws s3 mb s3://{self.bucket}" + (f" --endpoint-url {endpoint}" if endpoint else "")

    def _ensure_container(self) -> None:
        what = f"s3://{self.bucket}"
        retry = self.config.retry
        try:
            call_with_retry(retry, lambda: self._call(what, "head_bucket"))
            return
        except NotFound:
            pass
        kwargs: dict[str, Any] = {}
        region = self.config.s3.region
        if region and region != "us-east-1":  # AWS wants the region named, except its first one
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        call_with_retry(retry, lambda: self._create_bucket(what, kwargs))
        log.info("created bucket %s", what)

    def _create_bucket(self, what: str, kwargs: dict[str, Any]) -> None:
        try:
            with self._answer_watched(what):
                self.client.create_bucket(Bucket=self.bucket, **kwargs)
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code == "BucketAlreadyOwnedByYou":  # made by another process meanwhile
                return
            if code == "BucketAlreadyExists":
                raise ConfigError(
                    f"{what}: the bucket name is taken by another account; choose another bucket name"
                ) from None
            error = _map_error(exc, what)
            if isinstance(error, AuthError):
                raise AuthError(
                    f"{error}: bucket {self.bucket!r} does not exist and these credentials may not create it; "
                    f"create it with `{self._make_bucket_command()}` (on Swift's S3 API also "
                    f"`swift post {self.bucket}`) as a user who may, or write to an existing bucket"
                ) from None
            raise error from None
        except Exception as exc:
            raise _map_error(exc, what) from None

    # -- writing ----------------------------------------------------------------------
    def _write(self, key: str, stream: BinaryIO) -> None:
        try:
            self._write_object(key, stream)
        except NotFound as exc:
            if self._bucket_exists():
                raise
            raise NotFound(
                f"{exc}: bucket {self.bucket!r} does not exist; create it with `{self._make_bucket_command()}` "
                "(dlstore convert creates it)"
            ) from None

    def _bucket_exists(self) -> bool:
        """False only when the bucket is known to be missing; an error tells nothing here."""
        try:
            self._call(f"s3://{self.bucket}", "head_bucket")
        except NotFound:
            return False
        except DlstoreError:
            pass
        return True

    def _write_object(self, key: str, stream: BinaryIO) -> None:
        cfg = self.config.s3
        what = self.join(key)
        size = remaining_size(stream)
        threshold = max(cfg.multipart_threshold, 1)
        if size is not None and size < threshold:
            # Small and seekable: stream it in one PUT; the caller retries from the start.
            self._call(what, "put_object", Key=self._name(key), Body=stream, ContentLength=size)
            return
        # Parts large enough for `_MAX_PARTS` of them to hold the object when its size is
        # known; when not, `_multipart` grows them as it goes.
        configured = max(cfg.multipart_chunk_size, _MIN_PART)
        part_size = max(configured, -(-(size or 0) // _MAX_PARTS))
        if part_size > max(configured, _MAX_PART):
            # Refused before anything is uploaded, not at part 1,001.
            raise ConfigError(
                f"{what}: {size} bytes are more than one multipart upload holds "
                f"({_MAX_PARTS} parts of at most {_MAX_PART} bytes)"
            )
        first = read_block(stream, threshold)
        if len(first) < threshold:
            call_with_retry(self.config.retry, lambda: self._call(what, "put_object", Key=self._name(key), Body=first))
            return
        self._multipart(key, first, stream, part_size, grow=size is None)

    def _multipart(self, key: str, first: bytes, stream: BinaryIO, first_size: int, grow: bool) -> None:
        """Parts of `first_size` bytes, `first` then the stream; with `grow` the parts grow."""
        what = self.join(key)
        name = self._name(key)
        retry = self.config.retry
        upload = call_with_retry(retry, lambda: self._call(what, "create_multipart_upload", Key=name))
        upload_id = upload["UploadId"]
        parts: list[dict[str, Any]] = []
        try:
            pending = memoryview(first)
            while True:
                part_size = grown_part_size(first_size, len(parts), _MAX_PARTS, _MAX_PART) if grow else first_size
                if len(pending) >= part_size:
                    data, pending = bytes(pending[:part_size]), pending[part_size:]
                else:
                    data = bytes(pending) + read_block(stream, part_size - len(pending))
                    pending = memoryview(b"")
                if not data and parts:
                    break
                if len(parts) >= _MAX_PARTS:  # before the server's refusal of part 1,001
                    raise ConfigError(
                        f"{what}: the stream is longer than {_MAX_PARTS} parts of up to {part_size} bytes, the most "
                        "one multipart upload holds here; give a larger part size (DLSTORE_SEGMENT_SIZE) or the "
                        "size of the source"
                    )
                number = len(parts) + 1
                response = call_with_retry(
                    retry,
                    lambda d=data, n=number: self._call(
                        what, "upload_part", Key=name, UploadId=upload_id, PartNumber=n, Body=d
                    ),
                )
                parts.append({"PartNumber": number, "ETag": response["ETag"]})
                if len(data) < part_size:
                    break
            call_with_retry(
                retry,
                lambda: self._call(
                    what, "complete_multipart_upload", Key=name, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
        except BaseException:
            self._abort(what, name, upload_id)
            raise

    def remove_abandoned_uploads(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        """Abort the multipart uploads under `prefix` begun over `older_than_s` ago; their parts go."""
        cutoff = time.time() - older_than_s
        query: dict[str, Any] = {"Prefix": self._name(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")}
        removed = 0
        while True:
            page = call_with_retry(
                self.config.retry, lambda q=dict(query): self._call(self.url, "list_multipart_uploads", **q)
            )
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() <= cutoff:
                    what = f"s3://{self.bucket}/{upload['Key']}"
                    log.info("aborting a multipart upload of %s that never completed", what)
                    self._abort(what, upload["Key"], upload["UploadId"])
                    removed += 1
            if not page.get("IsTruncated"):
                return removed
            query.update(KeyMarker=page.get("NextKeyMarker", ""), UploadIdMarker=page.get("NextUploadIdMarker", ""))

    def _abort(self, what: str, name: str, upload_id: str) -> None:
        try:
            self._call(what, "abort_multipart_upload", Key=name, UploadId=upload_id)
        except DlstoreError as exc:
            log.warning(
                "could not abort the multipart upload of %s (its parts stay until a lifecycle rule): %s", what, exc
            )

    def _delete(self, key: str) -> None:
        # S3 answers 204 for a missing key; the contract wants NotFound, so look first.
        self._stat(key)
        self._deleted_once(lambda: self._call(self.join(key), "delete_object", Key=self._name(key)))
