"""Results on S3-compatible storage: ``s3://bucket/p`` keeps key ``a/b.csv`` at ``p/a/b.csv``.

A result is made whole atomically: bytes go out as parts of a multipart upload that is
*completed* only when the writer exits cleanly, and aborted on any error, so a reader sees
the whole object or none. A result smaller than one part is a single ``PutObject``, which S3
also shows whole or not at all. Memory stays flat whatever the size: one part is buffered at
a time (``PART_SIZE``), never the whole export.

A worker's result (a staged session) is uploaded under a key of its attempt's own
(``base.attempt_key``: ``<id>.attempt-2.csv`` beside ``<id>.csv``) when the writer exits,
BEFORE the fenced completion, and the completion records that key as the job's
``resultKey``: S3 has no rename, and an upload (a 40 s one was seen) made while the
completion held the job's row locked held up every lease renewal waiting on that row. A
losing attempt's upload is named by no job and is deleted (``discard``); one whose worker
died between the upload and its completion is left behind, named by no job, never served.

A worker killed mid-upload (``kill -9``) cannot abort: its parts stay invisible but billed
until the bucket's ``AbortIncompleteMultipartUpload`` lifecycle rule removes them (see
docs/how-to/results-and-email.md). The retry simply starts a new upload under its own key.

Why aiobotocore rather than boto3 in a thread: the worker runs up to ``JOBRELAY_PREFETCH``
jobs on one event loop, and every part upload of every job would otherwise hold a thread of
the default executor for its whole round trip; aiobotocore is botocore (the same signing,
retries, credential chain and endpoint rules as boto3) on aiohttp, so uploads are plain
awaits that cancellation and the heartbeat coexist with. Credentials and region come from
the standard AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_REGION``, profiles, roles).

Every botocore or connection error becomes a ``TransientError`` at this boundary: the worker
schedules a retry, and a job whose attempts run out is quarantined with the reason kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import mimetypes
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from aiobotocore.session import get_session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from jobrelay.errors import ConfigError, TransientError
from jobrelay.results.base import ResultWriter, StoredResult, attempt_key

MIN_PART_SIZE = 5 * 1024 * 1024  # S3's floor for every part but the last
PART_SIZE = 8 * 1024 * 1024
_READ_CHUNK = 64 * 1024
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_DEFAULT_REGION = "us-east-1"


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; the prefix may be empty."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigError("JOBRELAY_RESULTS_URL", f"expected s3://bucket[/prefix], got {url!r}")
    return parts.netloc, parts.path.strip("/")


@contextlib.asynccontextmanager
async def s3_errors(action: str) -> AsyncIterator[None]:
    """Translate what botocore and the network raise into our tree, at this one boundary."""
    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = error.get("Code", "unknown")
        raise TransientError(
            f"S3 {action} failed: {code} {error.get('Message', '')}".strip()
        ) from exc
    except (BotoCoreError, OSError, TimeoutError) as exc:
        raise TransientError(f"S3 {action} failed: {type(exc).__name__}: {exc}") from exc


def _not_found(exc: ClientError) -> bool:
    return str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND_CODES


class S3Results:
    def __init__(
        self, url: str, *, endpoint_url: str | None = None, part_size: int = PART_SIZE
    ) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes")
        self.bucket, self.prefix = parse_s3_url(url)
        self.endpoint_url = endpoint_url
        self.part_size = part_size
        self._session = get_session()
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._opening = asyncio.Lock()

    async def client(self) -> Any:
        """The one S3 client of this process, created on first use (it opens no connection)."""
        if self._client is None:
            async with self._opening:
                if self._client is None:
                    region = self._session.get_config_variable("region") or _DEFAULT_REGION
                    config = Config(
                        signature_version="s3v4",
                        # Self-hosted endpoints (MinIO, moto) have no per-bucket DNS names.
                        s3={"addressing_style": "path" if self.endpoint_url else "auto"},
                        retries={"max_attempts": 3, "mode": "standard"},
                        connect_timeout=5,
                        read_timeout=60,
                    )
                    async with s3_errors("client setup"):
                        self._client = await self._stack.enter_async_context(
                            self._session.create_client(
                                "s3",
                                endpoint_url=self.endpoint_url,
                                region_name=region,
                                config=config,
                            )
                        )
        return self._client

    def object_key(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"result key must be relative: {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def writer(self, key: str, *, staged: bool = False, attempt: int | None = None) -> S3Session:
        return S3Session(self, attempt_key(key, attempt) if staged else key, staged=staged)

    async def exists(self, key: str) -> bool:
        s3 = await self.client()
        async with s3_errors("HeadObject"):
            try:
                await s3.head_object(Bucket=self.bucket, Key=self.object_key(key))
            except ClientError as exc:
                if _not_found(exc):
                    return False
                raise
        return True

    async def delete(self, key: str) -> None:
        """``DeleteObject``, which S3 answers 204 for a key that is not there too."""
        s3 = await self.client()
        async with s3_errors("DeleteObject"):
            try:
                await s3.delete_object(Bucket=self.bucket, Key=self.object_key(key))
            except ClientError as exc:
                if not _not_found(exc):
                    raise

    async def read(self, key: str) -> AsyncIterator[bytes]:
        s3 = await self.client()
        async with s3_errors("GetObject"):
            try:
                response = await s3.get_object(Bucket=self.bucket, Key=self.object_key(key))
            except ClientError as exc:
                if _not_found(exc):
                    raise FileNotFoundError(self.describe(key)) from exc
                raise
            async with response["Body"] as body:
                async for chunk in body.iter_chunks(_READ_CHUNK):
                    yield chunk

    def describe(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.object_key(key)}"

    async def presign(self, key: str, seconds: int, *, filename: str | None = None) -> str | None:
        """A SigV4 GET URL for ``seconds``; signed locally, no request is made."""
        params: dict[str, str] = {"Bucket": self.bucket, "Key": self.object_key(key)}
        if filename is not None:
            params["ResponseContentDisposition"] = f'attachment; filename="{filename}"'
        s3 = await self.client()
        async with s3_errors("presign"):
            url = await s3.generate_presigned_url("get_object", Params=params, ExpiresIn=seconds)
        return str(url)

    async def aclose(self) -> None:
        self._client = None
        await self._stack.aclose()


class S3Session:
    """One result being written: buffered into parts, visible only after a clean exit.

    Staged (a worker's attempt): ``key`` is already the attempt's own key, the object is
    completed there on a clean exit like any other, ``publish()`` has nothing left to do
    and ``discard()`` deletes it (the attempt lost: no job may ever name it)."""

    def __init__(self, store: S3Results, key: str, *, staged: bool = False) -> None:
        self.store = store
        self._staged = staged
        self._uploaded = False  # staged: the object is whole at ``key``, named by no job yet
        self.key = key
        self.object_key = store.object_key(key)
        self.content_type = _content_type(key)
        self._buffer = io.BytesIO()
        self._parts: list[dict[str, Any]] = []
        self._upload_id: str | None = None
        self._size = 0
        self._digest = hashlib.sha256()
        self._result: StoredResult | None = None

    async def __aenter__(self) -> ResultWriter:
        return self

    async def write(self, chunk: bytes) -> None:
        self._digest.update(chunk)
        self._size += len(chunk)
        self._buffer.write(chunk)
        if self._buffer.tell() >= self.store.part_size:
            await self._upload_part(self._take_buffer())

    def _take_buffer(self) -> io.BytesIO:
        """The buffered part as a request body, and a fresh buffer: no copy is made. A
        file-like body is also what aiohttp streams in chunks (raw bytes it would send in
        one write that can stall the event loop), and what botocore rewinds to retry."""
        body, self._buffer = self._buffer, io.BytesIO()
        body.seek(0)
        return body

    async def _upload_part(self, body: io.BytesIO) -> None:
        s3 = await self.store.client()
        if self._upload_id is None:
            async with s3_errors("CreateMultipartUpload"):
                created = await s3.create_multipart_upload(
                    Bucket=self.store.bucket, Key=self.object_key, ContentType=self.content_type
                )
            self._upload_id = str(created["UploadId"])
        number = len(self._parts) + 1
        async with s3_errors("UploadPart"):
            uploaded = await s3.upload_part(
                Bucket=self.store.bucket,
                Key=self.object_key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
            )
        self._parts.append({"ETag": uploaded["ETag"], "PartNumber": number})

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            await self._abort()
            return
        try:
            if self._upload_id is not None and self._buffer.tell():
                await self._upload_part(self._take_buffer())
        except BaseException:
            await self._abort()
            raise
        self._result = StoredResult(self.key, self._size, self._digest.hexdigest())
        # Staged too, here: before the fenced completion, never under its lock. Marked
        # first, so a discard after a cancelled or failed upload still deletes what landed.
        self._uploaded = self._staged
        try:
            await self._commit()
        except Exception:
            await self._abort()
            raise

    async def publish(self) -> None:
        """Nothing left to do: the object is whole at ``key``, which the completion names."""

    async def discard(self) -> None:
        if self._uploaded:
            self._uploaded = False
            await self.store.delete(self.key)

    async def _commit(self) -> None:
        s3 = await self.store.client()
        if self._upload_id is None:
            async with s3_errors("PutObject"):
                await s3.put_object(
                    Bucket=self.store.bucket,
                    Key=self.object_key,
                    Body=self._take_buffer(),
                    ContentType=self.content_type,
                )
            return
        async with s3_errors("CompleteMultipartUpload"):
            await s3.complete_multipart_upload(
                Bucket=self.store.bucket,
                Key=self.object_key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )

    async def _abort(self) -> None:
        """Best effort: a failed abort leaves invisible parts for the lifecycle rule."""
        self._buffer = io.BytesIO()
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        with contextlib.suppress(Exception):
            s3 = await self.store.client()
            await s3.abort_multipart_upload(
                Bucket=self.store.bucket, Key=self.object_key, UploadId=upload_id
            )

    @property
    def result(self) -> StoredResult:
        if self._result is None:
            raise RuntimeError("result not committed")
        return self._result


def _content_type(key: str) -> str:
    guessed, _ = mimetypes.guess_type(key)
    if guessed is None:
        return "application/octet-stream"
    return f"{guessed}; charset=utf-8" if guessed.startswith("text/") else guessed
