"""The object store's contract, the same on a local directory and on S3 (moto's server, a
process speaking S3's HTTP): what a reader sees, what a failed or retried writer leaves,
which keys it refuses. Then what crosses hosts through it: an upload through the API, seen
in the bucket by boto3; a fine-tune's checkpoint and adapter, read on another "host" (a
store of its own, a cache directory of its own)."""

from __future__ import annotations

import io
import json

import openai
import pytest

from config import Settings
from engine.adapters import FILES, Adapters
from protocol import keys
from storage.objects import ObjectStore
from tests.api.conftest import UPLOAD_LIMIT, Untouchable, build, new_key
from tests.storage.conftest import keys_in


@pytest.fixture(params=["local", "s3"])
def url(request, tmp_path) -> str:
    if request.param == "local":
        return (tmp_path / "objects").as_uri()
    return f"s3://{request.getfixturevalue('bucket')}/prefix"


def put(store: ObjectStore, key: str, data: bytes) -> None:
    with store.writer(key) as f:
        f.write(data)


def get(store: ObjectStore, key: str) -> bytes:
    with store.open(key) as f:
        return f.read()


def leftovers(store: ObjectStore) -> list[str]:
    """Every object or file under the store's root (temporary ones included)."""
    return sorted(p.removeprefix(store.root.rstrip("/") + "/") for p in store.fs.find(store.root))


def test_what_is_written_is_read(url):
    store = ObjectStore(url)
    key = keys.checkpoint("ftjob-1", 3)
    assert not store.exists(key)
    put(store, key, b"weights")
    put(store, "files/empty", b"")
    assert store.exists(key) and store.size(key) == 7 and get(store, key) == b"weights"
    assert store.exists("files/empty") and store.size("files/empty") == 0 and get(store, "files/empty") == b""
    with pytest.raises(FileNotFoundError):
        store.open("files/missing")
    assert leftovers(store) == ["files/empty", key]


def test_a_failed_writer_leaves_nothing_and_keeps_what_was_there(url, request):
    store = ObjectStore(url)
    data = b"x" * (1 << 20)
    with pytest.raises(RuntimeError):
        with store.writer("files/new") as f:
            f.write(data)
            raise RuntimeError("the writer died")
    assert not store.exists("files/new")
    put(store, "files/old", b"old")
    with pytest.raises(RuntimeError):
        with store.writer("files/old") as f:
            f.write(data)
            raise RuntimeError("the writer died")
    assert get(store, "files/old") == b"old"
    assert leftovers(store) == ["files/old"]  # no temporary file either
    if url.startswith("s3://"):  # nor an upload left pending in the bucket (a failed one is aborted)
        s3, bucket = request.getfixturevalue("s3"), request.getfixturevalue("bucket")
        assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_a_retried_writer_replaces(url):
    store = ObjectStore(url)
    put(store, "files/a", b"first attempt, longer")
    put(store, "files/a", b"second")
    assert get(store, "files/a") == b"second" and store.size("files/a") == 6
    assert leftovers(store) == ["files/a"]


@pytest.mark.parametrize("key", ["", "/etc/passwd", "files/../../x", "files//a", "./files/a", "files/a/", "files/."])
def test_bad_keys_are_refused(url, key):
    store = ObjectStore(url)
    for use in (store.writer, store.open, store.exists, store.size):
        with pytest.raises(ValueError, match="bad object key"):
            with use(key):
                pass


def test_a_missing_bucket_is_a_clear_error(s3_endpoint):
    with pytest.raises(FileNotFoundError) as caught:
        ObjectStore("s3://ballast-no-such-bucket/objects")
    message = str(caught.value)
    assert "'ballast-no-such-bucket'" in message and "does not exist" in message
    assert "aws s3 mb s3://ballast-no-such-bucket" in message and "AWS_ENDPOINT_URL_S3" in message


async def test_an_upload_through_the_api_lands_in_the_bucket(tmp_path, db, s3, bucket):
    settings = Settings(data_dir=tmp_path, object_store=f"s3://{bucket}/ballast", served_model_name="ballast-tiny",
                        max_upload_bytes=UPLOAD_LIMIT)
    body = "".join(json.dumps(dict(custom_id=f"r{i}", method="POST", url="/v1/chat/completions",
                                   body=dict(model="ballast-tiny", messages=[dict(role="user", content="hi")])))
                   + "\n" for i in range(3)).encode()
    async with build(settings, db, Untouchable("temporal"), await new_key(db, "default")) as http:
        async with openai.AsyncOpenAI(base_url="http://ballast.test/v1", api_key=http.headers["Authorization"][7:],
                                      max_retries=0, http_client=http) as client:
            made = await client.files.create(file=("in.jsonl", io.BytesIO(body)), purpose="batch")
            assert made.bytes == len(body)
            assert (await client.files.content(made.id)).content == body
            with pytest.raises(openai.APIStatusError) as caught:  # too large: nothing is kept
                await client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (UPLOAD_LIMIT + 1))), purpose="batch")
            assert caught.value.status_code == 413
    assert keys_in(s3, bucket) == [f"ballast/{keys.file(made.id)}"]
    assert s3.get_object(Bucket=bucket, Key=f"ballast/{keys.file(made.id)}")["Body"].read() == body
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")


async def test_a_fine_tune_written_on_one_host_is_read_on_another(tmp_path, bucket):
    trainer_host = ObjectStore(f"s3://{bucket}/ballast")
    engine_host = ObjectStore(f"s3://{bucket}/ballast")
    checkpoint = bytes(range(256)) * 64
    put(trainer_host, keys.checkpoint("ftjob-x", 8), checkpoint)
    adapter = {"adapter_config.json": json.dumps(dict(r=8, lora_alpha=16)).encode(),
               "adapter_model.safetensors": b"\0" * 4096}
    for name, data in adapter.items():
        put(trainer_host, f"{keys.adapter('ftjob-x')}/{name}", data)

    # A chunk resumed on the other host reads the very bytes whose checksum the journal holds.
    assert get(engine_host, keys.checkpoint("ftjob-x", 8)) == checkpoint
    # Its engine worker materializes the adapter into its own cache, where vLLM loads it from.
    cache = tmp_path / "engine-host" / "adapters"
    lora = await Adapters(engine_host, cache).request("ft:ballast-tiny:s:ftjob-x")
    assert lora.lora_path == str(cache / "ftjob-x")
    assert {p.name: p.read_bytes() for p in (cache / "ftjob-x").iterdir()} == adapter
    # A second worker sharing that cache, fetching at the same time, finds it placed and keeps it.
    Adapters(engine_host, cache)._fetch("ftjob-x", cache / "ftjob-x")
    assert sorted(p.name for p in cache.iterdir()) == ["ftjob-x"]
    assert sorted(p.name for p in (cache / "ftjob-x").iterdir()) == sorted(FILES)
