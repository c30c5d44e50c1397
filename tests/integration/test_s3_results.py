"""The s3:// results backend on its own, against a real S3-compatible server (moto).

What the pipeline tests cannot see from outside: that a half-written result is never an
object, that a failed upload is aborted, that a retry of the same key leaves one object, and
that memory stays flat however large the result is.
"""

from __future__ import annotations

import hashlib
import tracemalloc
from typing import Any

import pytest

from jobrelay.errors import TransientError
from jobrelay.results.s3 import MIN_PART_SIZE, S3Results

from .effects_fixtures import (  # noqa: F401 (fixtures, registered by name)
    S3Server,
    aws_env_fixture,
    bucket_fixture,
    create_bucket,
    moto_subprocess,
    object_bytes,
    object_keys,
    open_uploads,
    s3_client,
    s3_server_fixture,
)

pytestmark = pytest.mark.timeout(120)
KEY = "exports/acme/0b0e3a40-3c0d-5f7e-9d1a-8f9b8d1c2e3f.csv"
FULL_KEY = f"results/{KEY}"
MiB = 1024 * 1024


@pytest.fixture
async def store(s3_server: S3Server, bucket: str) -> Any:
    await create_bucket(s3_server.endpoint, bucket)
    results = S3Results(
        f"s3://{bucket}/results/", endpoint_url=s3_server.endpoint, part_size=MIN_PART_SIZE
    )
    yield results
    await results.aclose()


async def test_small_result_is_one_put_at_the_stable_key(
    store: S3Results, s3_server: S3Server, bucket: str
) -> None:
    session = store.writer(KEY)
    async with session as out:
        await out.write(b"entry_id,amount\r\n")
        await out.write(b"1,2.00\r\n")
    data = b"entry_id,amount\r\n1,2.00\r\n"
    assert session.result.size == len(data)
    assert session.result.sha256 == hashlib.sha256(data).hexdigest()
    assert await object_keys(s3_server.endpoint, bucket) == [FULL_KEY]
    assert await object_bytes(s3_server.endpoint, bucket, FULL_KEY) == data
    async with s3_client(s3_server.endpoint) as s3:
        head = await s3.head_object(Bucket=bucket, Key=FULL_KEY)
    assert head["ContentType"] == "text/csv; charset=utf-8"
    assert await store.exists(KEY) and not await store.exists("exports/acme/other.csv")
    assert b"".join([c async for c in store.read(KEY)]) == data
    assert store.describe(KEY) == f"s3://{bucket}/{FULL_KEY}"


@pytest.mark.long
async def test_half_written_result_is_never_visible_and_is_aborted(
    store: S3Results, s3_server: S3Server, bucket: str
) -> None:
    with pytest.raises(RuntimeError, match="half-way"):
        async with store.writer(KEY) as out:
            await out.write(b"x" * (MIN_PART_SIZE + 1))  # one part is uploaded now
            assert await open_uploads(s3_server.endpoint, bucket) == [FULL_KEY]
            assert await object_keys(s3_server.endpoint, bucket) == []
            assert not await store.exists(KEY)
            raise RuntimeError("the export failed half-way")
    assert await open_uploads(s3_server.endpoint, bucket) == []
    assert await object_keys(s3_server.endpoint, bucket) == []


@pytest.mark.long
async def test_failed_completion_is_transient_leaves_nothing_and_a_retry_writes_once(
    store: S3Results, s3_server: S3Server, bucket: str
) -> None:
    part = b"a" * MIN_PART_SIZE
    with pytest.raises(TransientError, match="SlowDown"):
        async with store.writer(KEY) as out:
            await out.write(part)
            s3_server.failing = True  # the last part and the completion will be refused
            await out.write(b"tail")
    assert await object_keys(s3_server.endpoint, bucket) == []
    assert await open_uploads(s3_server.endpoint, bucket) == []  # aborted (a DELETE)
    s3_server.failing = False
    for attempt in (b"first", b"second"):  # the retry, and a duplicate run of the same job
        session = store.writer(KEY)
        async with session as out:
            await out.write(part)
            await out.write(attempt)
        assert session.result.size == MIN_PART_SIZE + len(attempt)
    assert await object_keys(s3_server.endpoint, bucket) == [FULL_KEY]
    stored = await object_bytes(s3_server.endpoint, bucket, FULL_KEY)
    assert stored == part + b"second"


@pytest.mark.long
async def test_unreachable_endpoint_is_a_transient_error(aws_env: None, bucket: str) -> None:
    from .effects_fixtures import free_port

    results = S3Results(f"s3://{bucket}", endpoint_url=f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(TransientError, match="Could not connect"):
            async with results.writer(KEY) as out:
                await out.write(b"x")
        with pytest.raises(TransientError):
            await results.exists(KEY)
    finally:
        await results.aclose()


@pytest.mark.long
async def test_large_result_streams_in_parts_with_flat_memory(aws_env: None, bucket: str) -> None:
    """48 MiB through 5 MiB parts: this process never holds much more than one part
    (measured: 7.4 MiB peak of traced Python memory).

    moto runs in a process of its own here, so its copy of the object is not counted.
    """
    total, chunk = 48 * MiB, bytes(range(256)) * 256  # 64 KiB chunks, like an export
    with moto_subprocess() as endpoint:
        await create_bucket(endpoint, bucket)
        results = S3Results(f"s3://{bucket}", endpoint_url=endpoint, part_size=MIN_PART_SIZE)
        try:
            await results.client()  # the client's service model is loaded once per process
            digest = hashlib.sha256()
            tracemalloc.start()
            try:
                session = results.writer(KEY)
                async with session as out:
                    for _ in range(total // len(chunk)):
                        await out.write(chunk)
                        digest.update(chunk)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert session.result.size == total
            assert session.result.sha256 == digest.hexdigest()
            async with s3_client(endpoint) as s3:
                head = await s3.head_object(Bucket=bucket, Key=KEY)
            assert head["ContentLength"] == total
            assert "-" in head["ETag"]  # a multipart object: it was streamed in parts
        finally:
            await results.aclose()
    print(f"peak traced memory writing {total // MiB} MiB: {peak / MiB:.1f} MiB")
    # One part buffered (+ the buffer's growth and the HTTP client's own chunks), never more.
    assert peak < 2 * MIN_PART_SIZE, f"peak {peak / MiB:.1f} MiB for a {total // MiB} MiB result"


async def test_delete_removes_the_object_and_a_missing_one_is_fine(
    store: S3Results, s3_server: S3Server, bucket: str
) -> None:
    async with store.writer(KEY) as out:
        await out.write(b"a,b\r\n")
    assert await object_keys(s3_server.endpoint, bucket) == [FULL_KEY]

    await store.delete(KEY)

    assert await object_keys(s3_server.endpoint, bucket) == []
    await store.delete(KEY)  # already gone: retention may repeat itself
    assert not await store.exists(KEY)


async def test_delete_on_an_unreachable_endpoint_is_a_transient_error(
    aws_env: None, bucket: str
) -> None:
    from jobrelay.chaos.sinks import free_port

    results = S3Results(f"s3://{bucket}", endpoint_url=f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(TransientError, match=r"DeleteObject failed.*Could not connect"):
            await results.delete(KEY)
    finally:
        await results.aclose()
