"""Swift writes and deletes: small objects in one PUT, large ones as static large objects.

Objects of `segment_size` bytes or more go as static large objects, SLOs. Segments go to
`<container>_segments`, made when missing, each buffered in memory and retried on its own.
The manifest follows them. A manifest lists at most so many segments: segments are made
larger up front when the size is known, and grow as the upload goes when it is not.
`ensure_container()` makes the container itself, as `swift upload` does. A plain put into
a missing container is `NotFound`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import secrets
import time
from typing import Any, BinaryIO

from dlstore.errors import AuthError, ConfigError, DlstoreError, NotFound
from dlstore.storage.base import ObjectInfo, grown_part_size, read_block, remaining_size
from dlstore.storage.retry import call_with_retry
from dlstore.storage.swift.auth import Forbidden, SwiftClient

__all__ = ["MAX_SEGMENTS", "MAX_SEGMENT_SIZE", "SloWrites"]

log = logging.getLogger(__name__)

#: Swift's defaults: a manifest lists at most 1,000 segments, `max_manifest_segments`. A
#: segment holds at most 5 GiB, `max_file_size`. A cluster's own are in its /info.
MAX_SEGMENTS = 1000
MAX_SEGMENT_SIZE = 5 * 2**30


class SloWrites(SwiftClient):
    """Puts, deletes and container creation of a Swift store."""

    def _write(self, key: str, stream: BinaryIO) -> None:
        try:
            self._write_object(key, stream)
        except NotFound as exc:
            self._client_segments_ready = False  # it may be gone too: looked at again by the next write
            # An object PUT answers 404 only when the container is missing.
            raise NotFound(
                f"{exc}: container {self.container!r} does not exist; create it with "
                f"`swift post {self.container}` (dlstore convert creates it)"
            ) from None

    def _slo_limits(self) -> tuple[int, int]:
        """The segments a manifest may list and the bytes a segment may hold on this cluster.

        They come from its /info, asked once per process, else Swift's defaults. A cluster
        set below the defaults would refuse a large upload only once all its segments are up.
        """
        limits = self.__dict__.get("_client_slo_limits")
        if limits is None or limits[0] != os.getpid():
            try:
                info = call_with_retry(self.config.retry, lambda: self._call(f"{self.url} (/info)", "get_capabilities"))
            except DlstoreError as exc:
                log.debug("no /info from the Swift cluster of %s (%s): Swift's default SLO limits", self.url, exc)
                info = {}
            slo, swift = info.get("slo") or {}, info.get("swift") or {}
            try:
                segments = int(slo.get("max_manifest_segments", MAX_SEGMENTS))
                segment_size = int(swift.get("max_file_size", MAX_SEGMENT_SIZE))
            except (TypeError, ValueError):
                segments, segment_size = MAX_SEGMENTS, MAX_SEGMENT_SIZE
            limits = self.__dict__["_client_slo_limits"] = (os.getpid(), max(segments, 1), max(segment_size, 1))
        return limits[1], limits[2]

    def _write_object(self, key: str, stream: BinaryIO) -> None:
        what = self.join(key)
        name = self._name(key)
        size = remaining_size(stream)
        max_segments, max_segment_size = self._slo_limits()
        # A known size gets segments large enough to fit the manifest; a stream's grow in `_put_slo`.
        configured = max(self.config.swift.segment_size, 1)
        segment_size = max(configured, -(-(size or 0) // max_segments))
        if segment_size > max(configured, max_segment_size):
            # Refused before anything is uploaded, not by a 413 once it all is.
            raise ConfigError(
                f"{what}: {size} bytes are more than one static large object holds here "
                f"({max_segments} segments of at most {max_segment_size} bytes)"
            )
        old_segments = call_with_retry(self.config.retry, lambda: self._segments_of(key))
        if size is not None and size < segment_size:
            # Small and seekable: stream it in one PUT; base.put retries from the start.
            self._call(
                what, "put_object", self.container, name, stream, content_length=size, chunk_size=self.config.chunk_size
            )
        else:
            first = read_block(stream, segment_size)
            if len(first) < segment_size:
                call_with_retry(self.config.retry, lambda: self._put_bytes(what, self.container, name, first))
            else:
                self._put_slo(key, first, stream, segment_size, grow=size is None)
        self._delete_segments(what, old_segments)

    def _put_bytes(self, what: str, container: str, name: str, data: bytes, **kwargs: Any) -> str:
        # A file object, not bytes: swiftclient treats bytes as not replayable.
        return self._call(what, "put_object", container, name, io.BytesIO(data), content_length=len(data), **kwargs)

    def _put_slo(self, key: str, first: bytes, stream: BinaryIO, segment_size: int, grow: bool) -> None:
        """Segments of `segment_size` bytes, each retried on its own, then the manifest.

        `first` is the first segment. With `grow`, for a stream of unknown length, segments
        grow as `grown_part_size` says, so the manifest's segment limit is not reached.
        """
        what = self.join(key)
        retry = self.config.retry
        max_segments, max_segment_size = self._slo_limits()
        self._ensure_segment_container()
        upload = f"{time.time():.6f}-{secrets.token_hex(4)}"
        segment_prefix = f"{self._name(key)}/slo/{upload}/"
        manifest: list[dict[str, Any]] = []
        try:
            data = first
            size = segment_size
            while data:
                if len(manifest) >= max_segments:  # before the 413 of a manifest too long
                    raise ConfigError(
                        f"{what}: the stream is longer than {max_segments} segments of up to {size} bytes, "
                        "the most one static large object holds; give a larger segment size "
                        "(DLSTORE_SEGMENT_SIZE) or the size of the source"
                    )
                segment = f"{segment_prefix}{len(manifest):08d}"
                etag = call_with_retry(
                    retry, lambda d=data, s=segment: self._put_bytes(what, self.segment_container, s, d)
                )
                manifest.append(
                    {"path": f"/{self.segment_container}/{segment}", "etag": etag.strip('"'), "size_bytes": len(data)}
                )
                if len(data) < size:
                    break
                if grow:
                    size = grown_part_size(segment_size, len(manifest), max_segments, max_segment_size)
                data = read_block(stream, size)
            body = json.dumps(manifest)
            call_with_retry(
                retry,
                lambda: self._call(
                    what, "put_object", self.container, self._name(key), body, query_string="multipart-manifest=put"
                ),
            )
        except BaseException:
            self._delete_segments(what, [entry["path"] for entry in manifest])
            raise

    def _ensure_segment_container(self) -> None:
        self._process_state()
        if not self._client_segments_ready:
            self._make_container(self.segment_container)
            self._client_segments_ready = True

    def _ensure_container(self) -> None:
        self._make_container(self.container)

    def _make_container(self, container: str) -> None:
        """PUT the container unless a HEAD finds it.

        A user granted an existing container by an ACL may not PUT containers, and needs not.
        """
        what = f"swift://{container}"
        retry = self.config.retry
        how = (
            f"create it with `swift post {container}` as a user who may (the account's owner, a project "
            "member with the object-store role), or use a container you may write to"
        )
        try:
            call_with_retry(retry, lambda: self._call(what, "head_container", container))
            return
        except NotFound:
            pass
        except Forbidden as exc:  # no access to this container, if it exists at all
            raise AuthError(f"{exc}: these credentials may not read container {container!r}; {how}") from None
        try:
            call_with_retry(retry, lambda: self._call(what, "put_container", container))
        except Forbidden as exc:
            raise AuthError(
                f"{exc}: container {container!r} does not exist and these credentials may not create it; {how}"
            ) from None
        log.info("created container %s", what)

    def _segments_of(self, key: str) -> list[str]:
        """The segment paths of `key` if it is a static large object now, else []."""
        try:
            headers = self._call(self.join(key), "head_object", self.container, self._name(key))
        except NotFound:
            return []
        if headers.get("x-static-large-object", "").lower() != "true":
            return []
        _, body = self._call(
            self.join(key), "get_object", self.container, self._name(key), query_string="multipart-manifest=get"
        )
        return [entry["name"] for entry in json.loads(body)]

    def remove_abandoned_uploads(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        """Remove segments under `prefix` that no manifest names; returns the uploads cleaned.

        Only uploads whose every segment is older than `older_than_s` count: one still going
        writes new ones.
        """
        root = f"swift://{self.segment_container}" + (f"/{self.prefix}" if self.prefix else "")
        uploads: dict[tuple[str, str], list[ObjectInfo]] = {}
        try:
            for info in type(self)(root, self.config).list(prefix):
                key, slo, rest = info.key.partition("/slo/")
                if slo:
                    uploads.setdefault((key, rest.split("/", 1)[0]), []).append(info)
        except NotFound:  # no segment container: no segments
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        for (key, _), segments in sorted(uploads.items()):
            if any(info.mtime is None or info.mtime > cutoff for info in segments):
                continue
            named = set(call_with_retry(self.config.retry, lambda k=key: self._segments_of(k)))
            paths = [f"/{self.segment_container}/{self._name(info.key)}" for info in segments]
            stale = [path for path in paths if path not in named]
            if stale:
                log.info("removing %d segments of an upload of %s that never completed", len(stale), self.join(key))
                self._delete_segments(self.join(key), stale)
                removed += 1
        return removed

    def _delete_segments(self, what: str, paths: list[str]) -> None:
        """Best effort: a left-over segment costs space, never correctness."""
        for path in paths:
            container, _, name = path.lstrip("/").partition("/")
            try:
                call_with_retry(self.config.retry, lambda c=container, n=name: self._call(what, "delete_object", c, n))
            except NotFound:
                pass
            except DlstoreError as exc:
                log.warning("could not delete old segment %s of %s: %s", path, what, exc)

    def _delete(self, key: str) -> None:
        # `?multipart-manifest=delete` removes an SLO with its segments, but answers 200 and
        # deletes nothing for a plain object. So look first, which also gives NotFound.
        what = self.join(key)
        headers = self._call(what, "head_object", self.container, self._name(key))
        is_slo = headers.get("x-static-large-object", "").lower() == "true"
        query = "multipart-manifest=delete" if is_slo else None
        self._deleted_once(
            lambda: self._call(what, "delete_object", self.container, self._name(key), query_string=query)
        )
