"""`SwiftStore`: listings and reads here, writes in `upload`, logins and calls in `auth`."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from dlstore.config import StoreConfig, SwiftConfig  # noqa: F401 - the doctest's
from dlstore.errors import DlstoreError, NotFound, ObjectChanged, TransientError
from dlstore.storage.base import ObjectInfo, ReadPin, answered_range, check_key, skip_prefix
from dlstore.storage.retry import call_with_retry
from dlstore.storage.swift.auth import PreconditionFailed, RangeNotSatisfiable, map_error
from dlstore.storage.swift.upload import SloWrites

__all__ = ["SwiftStore", "parse_byteranges"]

_CONTENT_RANGE = re.compile(rb"content-range:\s*bytes\s+(\d+)-(\d+)/", re.IGNORECASE)
_SINGLE_RANGE = re.compile(r"\s*bytes\s+(\d+)-(\d+)/")


def parse_byteranges(body: bytes, boundary: bytes) -> dict[int, bytes]:
    """The bytes of each part of a multipart/byteranges `body` by first byte, as RFC 9110 14.6 says.

    >>> parse_byteranges(b"--b\\r\\nContent-Range: bytes 2-4/9\\r\\n\\r\\nabc\\r\\n--b--", b"b")
    {2: b'abc'}
    """
    parts: dict[int, bytes] = {}
    delimiter = b"--" + boundary
    position = body.find(delimiter)
    while position >= 0 and not body.startswith(b"--", position + len(delimiter)):
        head_end = body.find(b"\r\n\r\n", position)
        found = _CONTENT_RANGE.search(body, position, head_end) if head_end >= 0 else None
        if found is None:
            raise TransientError("a multipart/byteranges answer has a part without its Content-Range")
        start, end = int(found[1]), int(found[2])
        data = head_end + 4
        parts[start] = body[data : data + end - start + 1]
        if len(parts[start]) != end - start + 1:
            raise TransientError(f"a multipart/byteranges answer ends inside its part of bytes {start}-{end}")
        position = body.find(delimiter, data + end - start + 1)
    return parts


class SwiftStore(SloWrites):
    """Objects in one Swift container under a prefix, on python-swiftclient.

    Credentials come from the environment or from `config`: v1 tempauth's `ST_*`, Keystone
    v2 or v3 from an openrc's `OS_*`, or a storage URL and token. No connection is made yet:

    >>> config = StoreConfig(swift=SwiftConfig(storage_url="http://127.0.0.1:8080/v1/AUTH_test", auth_token="t"))
    >>> store = SwiftStore("swift://container/train", config)
    >>> store.url
    'swift://container/train'
    """

    scheme = "swift"
    reads_versions = True
    #: Swift serves up to 50 ascending byte ranges in one GET: `swift.common.swob.MAX_RANGES`.
    ranges_per_get = 50

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        full_prefix = self._name(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        marker = ""
        while True:
            # One page per request, each retried on its own, resumed from the last name seen.
            try:
                _, page = call_with_retry(
                    self.config.retry,
                    lambda m=marker: self._call(
                        self.url, "get_container", self.container, marker=m, prefix=full_prefix or None
                    ),
                )
            except NotFound as exc:  # a container listing answers 404 only when it is missing
                raise NotFound(f"{exc}: container {self.container!r} does not exist") from None
            if not page:
                return
            for item in page:
                if "name" not in item:  # a `subdir` entry; none without a delimiter
                    continue
                yield ObjectInfo(
                    key=item["name"][strip:],
                    size=int(item["bytes"]),
                    etag=item.get("hash"),
                    mtime=_listing_time(item.get("last_modified")),
                )
            marker = page[-1].get("name") or page[-1].get("subdir")

    def _stat(self, key: str) -> ObjectInfo:
        headers = self._call(self.join(key), "head_object", self.container, self._name(key))
        return ObjectInfo(
            key=key,
            size=int(headers["content-length"]),
            etag=(headers.get("etag") or "").strip('"') or None,
            mtime=float(headers["x-timestamp"]) if headers.get("x-timestamp") else None,
        )

    def _read(self, key: str, start: int, end: int | None, pin: ReadPin | None = None) -> Iterator[bytes]:
        what = self.join(key)
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if pin is not None and pin.etag:
            headers["If-Match"] = pin.etag  # a resume: the version read so far, or 412
        answer: dict[str, Any] = {}
        try:
            response_headers, body = self._call(
                what,
                "get_object",
                self.container,
                self._name(key),
                resp_chunk_size=self.config.chunk_size,
                headers=headers or None,
                response_dict=answer,
            )
        except RangeNotSatisfiable:  # the range starts at or past the end: no bytes
            return
        except PreconditionFailed:
            raise ObjectChanged(f"{what}: the object was replaced while it was read") from None
        expected = int(response_headers["content-length"]) if "content-length" in response_headers else None
        try:
            status = int(answer.get("status") or (206 if "content-range" in response_headers else 200))
            skip, size = answered_range(what, start, end, status, response_headers.get("content-range"), expected)
        except DlstoreError:
            body.close()
            raise
        if pin is not None:
            pin.note(response_headers.get("etag"), size)
        received = 0
        # urllib3's bytes as they come: no copies, no hashing. Closing an abandoned generator
        # drops its half-read connection.
        with contextlib.closing(self._body_chunks(body, what)) as chunks:
            for chunk in chunks:
                received += len(chunk)
                if skip:  # the whole object came: its bytes before `start` are not the range's
                    chunk, skip = skip_prefix(chunk, skip)
                    if not chunk:
                        continue
                yield chunk
        if expected is not None and received != expected:
            raise TransientError(f"short read of {what}: {received} of {expected} bytes")

    def _body_chunks(self, body: Any, what: str) -> Iterator[bytes]:
        """The chunks of a streamed body, closed at the end, also when the caller abandons it.

        A failure mid-body comes as our error. A stall cut from the watch's thread, through
        urllib3's `HTTPResponse.shutdown`, comes as `StalledRead`.
        """
        read = self._stall_watch().watch(body.resp.raw.shutdown)
        chunks = iter(body)
        try:
            while True:
                with read.waiting():
                    chunk = next(chunks, None)
                if chunk is None:
                    break
                yield chunk
        except Exception as exc:
            raise self._stalled(what) if read.cut else map_error(exc, what) from None
        finally:
            read.done()
            body.close()  # also drops a connection left half-read by an abandoned generator
        if read.cut:  # a cut body may also just end early
            raise self._stalled(what)

    def get_ranges(self, key: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """All `spans` in one GET: at most `ranges_per_get`, ascending and apart.

        The answer is multipart/byteranges, or one plain 206 when only one span lies inside
        the object. A span past the end comes back short, as `get_range` gives it. A server
        that answers with the whole object is asked one span per GET from then on; its body
        is not read. A transient failure retries the whole GET.
        """
        if len(spans) <= 1 or len(spans) > self.ranges_per_get:
            return super().get_ranges(key, spans)
        key = check_key(key)
        what = self.join(key)
        header = "bytes=" + ",".join(f"{start}-{start + length - 1}" for start, length in spans)

        def attempt() -> list[bytes] | None:
            response_headers, body = self._call(
                what, "get_object", self.container, self._name(key), headers={"Range": header}, resp_chunk_size=2**20
            )
            kind, _, parameters = response_headers.get("content-type", "").partition(";")
            boundary = dict(p.strip().split("=", 1) for p in parameters.split(";") if "=" in p).get("boundary")
            single = _SINGLE_RANGE.match(response_headers.get("content-range", ""))
            if kind.strip() == "multipart/byteranges" and boundary:
                parts = parse_byteranges(b"".join(self._body_chunks(body, what)), boundary.strip('"').encode()).items()
            elif single:  # one span lay inside the object: a plain 206 of it
                parts = {int(single[1]): b"".join(self._body_chunks(body, what))}.items()
            else:  # the whole object: not read
                body.close()
                return None
            # A server may join neighbouring ranges into one part: each span from the part holding it.
            return [
                next((data[s - first : s - first + n] for first, data in parts if first <= s < first + len(data)), b"")
                for s, n in spans
            ]

        got = call_with_retry(self.config.retry, attempt)
        if got is None:
            self.ranges_per_get = 1  # this server's GETs take one range: ask so from now on
            return super().get_ranges(key, spans)
        return got


def _listing_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None
