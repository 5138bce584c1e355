"""/v1/files: upload, list, read and delete a tenant's files (OpenAI shape).

What a tenant keeps is bounded: at most `max_files_per_tenant` files and
`max_file_bytes_per_tenant` bytes (its batches' and fine-tuning jobs' output files count,
though they are always written), file names of at most 255 characters, and files may
expire (`expires_after`). An expired file answers as a deleted one until the sweep
(journal.batch_store.sweep_expired_files) removes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, BinaryIO, Literal

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from api.deps import ServicesDep, TenantDep
from api.errors import APIError, check_text, not_found, possible_id, require_id
from config import Settings
from journal import batch_store
from protocol import keys
from protocol.schema import errors
from storage.objects import ObjectStore

log = logging.getLogger("ballast.api")

router = APIRouter(prefix="/v1/files")

UPLOAD_PURPOSES = ("batch", "fine-tune")
_COPY = 1 << 20
MAX_FILENAME = 255  # characters
# OpenAI's bounds on `expires_after[seconds]` (and a batch's `output_expires_after`): an
# hour to 30 days.
EXPIRES_AFTER_S = (3600, 2_592_000)
LIST_LIMIT = 10_000  # OpenAI's default and largest page
# What a listing may filter by: OpenAI's purposes (this deployment holds the batch and
# fine-tuning ones; the others list nothing).
PURPOSES = Literal["assistants", "assistants_output", "batch", "batch_output", "fine-tune", "fine-tune-results",
                   "vision", "user_data", "evals"]
# Not retried by OpenAI's clients: waiting does not free a tenant's storage, deleting does.
_NO_RETRY = {"x-should-retry": "false"}


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return dict(id=row["id"], object="file", bytes=row["bytes"], created_at=row["created_at"],
                filename=row["filename"], purpose=row["purpose"], status="processed",
                expires_at=row.get("expires_at"), status_details=None)


def new_file_id(now: float) -> str:
    """`file-` and 24 hex digits: the millisecond, then 48 random bits. Files made in the
    same second then list in the order they were made (by created_at, then id)."""
    return f"file-{int(now * 1000):012x}{uuid.uuid4().hex[:12]}"


def _by_id(operation: str) -> dict:
    return {"operationId": operation, "parameters": {"file_id": "$response.body#/id"}}


# OpenAPI links, which schemathesis follows: an upload's id is what the other file
# operations and a batch take.
_UPLOADED: dict[int | str, Any] = {200: {"description": "The file object.", "links": {
    "retrieveFile": _by_id("retrieveFile"), "downloadFile": _by_id("downloadFile"),
    "createBatch": {"operationId": "createBatch", "requestBody": {
        "input_file_id": "$response.body#/id", "endpoint": "/v1/chat/completions", "completion_window": "24h"}},
}}}
# Raw bytes, so no schema (OpenAPI 3.1's way to say so): a file whose bytes happen to be
# JSON, `8`, is still not a JSON string.
_CONTENT: dict[int | str, Any] = {200: {"description": "The file's bytes.",
                                       "content": {"application/octet-stream": {}}}}
_DELETED: dict[int | str, Any] = {200: {"description": "The file is deleted: its record and its bytes.",
                                       "content": {"application/json": {"schema": {
                                           "type": "object", "required": ["id", "object", "deleted"],
                                           "properties": {"id": {"type": "string"}, "object": {"const": "file"},
                                                          "deleted": {"const": True}}}}}}}
_LIST: dict[int | str, Any] = {200: {"description": "The tenant's files, a page of them.",
                                    "content": {"application/json": {"schema": {
                                        "type": "object",
                                        "required": ["object", "data", "first_id", "last_id", "has_more"],
                                        "properties": {"object": {"const": "list"},
                                                       "data": {"type": "array", "items": {"type": "object"}},
                                                       "first_id": {"type": ["string", "null"]},
                                                       "last_id": {"type": ["string", "null"]},
                                                       "has_more": {"type": "boolean"}}}}}}}


@router.post("", operation_id="createFile", responses=_UPLOADED | errors(400, 409, 413, 503))
async def upload(request: Request, svc: ServicesDep, tenant: TenantDep, file: UploadFile,
                 purpose: str = Form(json_schema_extra={"enum": list(UPLOAD_PURPOSES)}),  # documented, checked below
                 expires_anchor: str | None = Form(None, alias="expires_after[anchor]",
                                                   json_schema_extra={"enum": ["created_at"]}),
                 expires_seconds: int | None = Form(None, alias="expires_after[seconds]",
                                                    json_schema_extra={"minimum": EXPIRES_AFTER_S[0],
                                                                       "maximum": EXPIRES_AFTER_S[1]})):
    s = svc.settings
    if purpose not in UPLOAD_PURPOSES:
        raise APIError(400, f"Invalid purpose {purpose!r}: this deployment accepts {', '.join(UPLOAD_PURPOSES)}.",
                       param="purpose", code="invalid_value")
    filename = check_filename(file.filename or "upload.jsonl")
    lifetime = expires_after(expires_anchor, expires_seconds)
    now = time.time()
    file_id = new_file_id(now)
    key = keys.file(file_id)
    # In a thread: the store may be a bucket across the network (the body is already
    # spooled here, so reading it there blocks on nothing else). The object comes first and
    # the quota decision after, serialised with the tenant's other uploads: a refused
    # upload's object is removed (the body is spooled before this runs, whatever it decides).
    try:
        size = await asyncio.to_thread(_store, svc.store, key, file.file, s.max_upload_bytes)
    except OSError as err:  # the store is full or unwritable: nothing was kept, and it may pass
        log.warning("the object store refused an upload: %s", err)
        raise APIError(503, f"The file store cannot take the file right now ({err.strerror or err}); "
                            "try again later.", code="storage_unavailable", headers={"Retry-After": "30"}) from err
    if size == 0:
        await asyncio.to_thread(svc.store.delete, [key])
        raise APIError(400, "The uploaded file is empty.", param="file", code="empty_file")
    row = dict(id=file_id, tenant=tenant, purpose=purpose, filename=filename,
               bytes=size, object_key=key, created_at=int(now))
    expires_at = None if lifetime is None else int(now) + lifetime
    try:
        async with svc.db.begin() as conn:
            await batch_store.lock_tenant_files(conn, tenant)
            n, used = await batch_store.storage_used(conn, tenant, now)
            check_quota(s, tenant, n, used, size)
            await batch_store.create_file(conn, row, expires_at)
    except APIError:  # refused: no row, and so no object either
        await asyncio.to_thread(svc.store.delete, [key])
        raise
    except Exception:
        await _forget_unrecorded(svc, key, file_id, tenant)
        raise
    return file_object(dict(row, expires_at=expires_at))


async def _forget_unrecorded(svc, key: str, file_id: str, tenant: str) -> None:
    """After a failed insert, remove the object unless its row committed after all (a
    COMMIT whose answer was lost): a row must never point at nothing, while an object
    without a row is only a leak, which is what remains when the database cannot say."""
    try:
        async with svc.db.connect() as conn:
            recorded = await batch_store.get_file(conn, file_id, tenant) is not None
        if not recorded:
            await asyncio.to_thread(svc.store.delete, [key])
    except Exception as err:
        log.warning("upload %s failed; its object %s may be left without a record: %s", file_id, key, err)


def check_filename(name: str) -> str:
    check_text(name, "file", "The file name")
    if len(name) > MAX_FILENAME:
        raise APIError(400, f"The file name is {len(name)} characters long; at most {MAX_FILENAME} are allowed.",
                       param="file", code="invalid_value")
    return name


def expires_after(anchor: str | None, seconds: int | None, param: str = "expires_after") -> int | None:
    """Seconds the file lives after its creation, from OpenAI's `expires_after` (anchor
    `created_at`, seconds an hour to 30 days); None: until deleted."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise APIError(400, f"{param}[anchor] must be 'created_at'" + ("" if anchor is None else f", not {anchor!r}")
                       + f" (with {param}[seconds]).", param=f"{param}[anchor]", code="invalid_value")
    lo, hi = EXPIRES_AFTER_S
    if seconds is None or not lo <= seconds <= hi:
        raise APIError(400, f"{param}[seconds] must be a number of seconds from {lo} (an hour) to {hi} (30 days)"
                       + ("." if seconds is None else f", not {seconds}."), param=f"{param}[seconds]",
                       code="invalid_value")
    return seconds


def check_quota(s: Settings, tenant: str, files: int, used: int, size: int) -> None:
    """Refuse an upload of `size` bytes that would take the tenant past its storage limits."""
    if files >= s.max_files_per_tenant:
        raise APIError(409, f"Tenant {tenant!r} keeps {files} files, as many as it may ({s.max_files_per_tenant} "
                            "files per tenant): delete files it no longer needs (DELETE /v1/files/{file_id}; "
                            "GET /v1/files lists them) or let them expire, then upload again.",
                       param="file", code="file_count_limit_exceeded", headers=_NO_RETRY)
    if used + size > s.max_file_bytes_per_tenant:
        raise APIError(413, f"This upload of {size} bytes would bring the files tenant {tenant!r} keeps to "
                            f"{used + size} bytes, over its limit of {s.max_file_bytes_per_tenant} bytes: delete "
                            "files it no longer needs (DELETE /v1/files/{file_id}; GET /v1/files lists them) or "
                            "let them expire, then upload again.", param="file",
                       code="file_storage_limit_exceeded", headers=_NO_RETRY)


def _store(store: ObjectStore, key: str, body: BinaryIO, limit: int) -> int:
    """Copy an upload into the store; only a complete upload within the limit becomes an
    object. Returns its size."""
    size = 0
    with store.writer(key) as out:
        while chunk := body.read(_COPY):
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            out.write(chunk)
    return size


def too_large(limit: int) -> APIError:
    return APIError(413, f"The file exceeds the maximum upload size of {limit} bytes.", param="file",
                    code="file_too_large")


@router.get("", operation_id="listFiles", responses=_LIST | errors(400))
async def list_(svc: ServicesDep, tenant: TenantDep, after: str | None = None,
                limit: int = Query(LIST_LIMIT, ge=1, le=LIST_LIMIT),
                order: Literal["asc", "desc"] = "desc", purpose: PURPOSES | None = None):
    """The tenant's files, newest first (`order=asc`: oldest first). OpenAI's default page is
    its largest, 10,000; the per-tenant file limit bounds what any page can hold."""
    if after is not None and not possible_id(after):
        rows: list[dict[str, Any]] = []  # a cursor that cannot exist pages like one that does not
    else:
        async with svc.db.connect() as conn:
            rows = await batch_store.list_files(conn, tenant, now=time.time(), limit=limit + 1, after=after,
                                                order=order, purpose=purpose)
    data = [file_object(r) for r in rows[:limit]]
    return dict(object="list", data=data, first_id=data[0]["id"] if data else None,
                last_id=data[-1]["id"] if data else None, has_more=len(rows) > limit)


@router.get("/{file_id}", operation_id="retrieveFile", responses=errors(404))
async def retrieve(file_id: str, svc: ServicesDep, tenant: TenantDep):
    require_id("file", file_id, "file_id")
    async with svc.db.connect() as conn:
        row = await batch_store.get_file(conn, file_id, tenant, now=time.time())
    if row is None:
        raise not_found("file", file_id, "file_id")
    return file_object(row)


@router.delete("/{file_id}", operation_id="deleteFile", responses=_DELETED | errors(404, 409))
async def delete(file_id: str, svc: ServicesDep, tenant: TenantDep):
    """The file's record, then its bytes. One that an open batch or an unfinished
    fine-tuning job still reads is refused (409 file_in_use), not pulled from under it."""
    require_id("file", file_id, "file_id")
    try:
        async with svc.db.begin() as conn:
            row = await batch_store.delete_file(conn, file_id, tenant, time.time())
    except batch_store.FileInUse as err:
        raise APIError(409, f"File {file_id} cannot be deleted while {err.user} still needs it: delete it once "
                            "that has ended (or cancel it).", param="file_id", code="file_in_use",
                       headers=_NO_RETRY) from err
    if row is None:
        raise not_found("file", file_id, "file_id")
    # The record is gone: nobody reaches the object any more. Failing to remove it leaks
    # storage, which is logged, and the file stays deleted.
    try:
        await asyncio.to_thread(svc.store.delete, [row["object_key"]])
    except OSError as err:
        log.warning("file %s is deleted but its object %s could not be removed: %s", file_id, row["object_key"], err)
    return dict(id=file_id, object="file", deleted=True)


@router.get("/{file_id}/content", operation_id="downloadFile", response_class=StreamingResponse,
            responses=_CONTENT | errors(404))
async def content(file_id: str, svc: ServicesDep, tenant: TenantDep):
    require_id("file", file_id, "file_id")
    async with svc.db.connect() as conn:
        row = await batch_store.get_file(conn, file_id, tenant, now=time.time())
    if row is None:
        raise not_found("file", file_id, "file_id")
    try:
        f = await asyncio.to_thread(svc.store.open, row["object_key"])  # on S3, a request
    except FileNotFoundError:  # deleted between the two reads
        raise not_found("file", file_id, "file_id") from None

    def chunks():
        with f:
            while data := f.read(_COPY):
                yield data

    # Whatever a tenant uploaded, a browser never renders it as a page of this origin.
    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"Content-Length": str(row["bytes"]), "X-Content-Type-Options": "nosniff",
                                      "Content-Disposition": "attachment"})
