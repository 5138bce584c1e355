"""/v1/files: upload batch input, read file objects and their content (OpenAI shape)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, BinaryIO

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import StreamingResponse

from api.deps import ServicesDep, TenantDep
from api.errors import APIError, check_text, not_found, require_id
from journal import batch_store
from protocol import keys
from protocol.schema import errors
from storage.objects import ObjectStore

log = logging.getLogger("ballast.api")

router = APIRouter(prefix="/v1/files")

UPLOAD_PURPOSES = ("batch", "fine-tune")
_COPY = 1 << 20


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return dict(id=row["id"], object="file", bytes=row["bytes"], created_at=row["created_at"],
                filename=row["filename"], purpose=row["purpose"], status="processed",
                expires_at=None, status_details=None)


def _by_id(operation: str) -> dict:
    return {"operationId": operation, "parameters": {"file_id": "$response.body#/id"}}


# OpenAPI links, which schemathesis follows: an upload's id is what the other file
# operations and a batch take.
_UPLOADED: dict[int | str, Any] = {200: {"description": "The file object.", "links": {
    "retrieveFile": _by_id("retrieveFile"), "downloadFile": _by_id("downloadFile"),
    "createBatch": {"operationId": "createBatch", "requestBody": {
        "input_file_id": "$response.body#/id", "endpoint": "/v1/chat/completions", "completion_window": "24h"}},
}}}
_CONTENT: dict[int | str, Any] = {200: {"description": "The file's bytes.",
                                       "content": {"application/octet-stream": {"schema": {"type": "string"}}}}}


@router.post("", operation_id="createFile", responses=_UPLOADED | errors(400, 413, 503))
async def upload(request: Request, svc: ServicesDep, tenant: TenantDep, file: UploadFile,
                 purpose: str = Form(json_schema_extra={"enum": list(UPLOAD_PURPOSES)})):  # documented, checked below
    limit = svc.settings.max_upload_bytes
    if purpose not in UPLOAD_PURPOSES:
        raise APIError(400, f"Invalid purpose {purpose!r}: this deployment accepts {', '.join(UPLOAD_PURPOSES)}.",
                       param="purpose", code="invalid_value")
    filename = check_text(file.filename or "upload.jsonl", "file", "The file name")
    file_id = "file-" + uuid.uuid4().hex[:24]
    key = keys.file(file_id)
    # In a thread: the store may be a bucket across the network (the body is already
    # spooled here, so reading it there blocks on nothing else).
    try:
        size = await asyncio.to_thread(_store, svc.store, key, file.file, limit)
    except OSError as err:  # the store is full or unwritable: nothing was kept, and it may pass
        log.warning("the object store refused an upload: %s", err)
        raise APIError(503, f"The file store cannot take the file right now ({err.strerror or err}); "
                            "try again later.", code="storage_unavailable", headers={"Retry-After": "30"}) from err
    if size == 0:
        raise APIError(400, "The uploaded file is empty.", param="file", code="empty_file")
    row = dict(id=file_id, tenant=tenant, purpose=purpose, filename=filename,
               bytes=size, object_key=key, created_at=int(time.time()))
    async with svc.db.begin() as conn:
        await batch_store.create_file(conn, row)
    return file_object(row)


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


@router.get("/{file_id}", operation_id="retrieveFile", responses=errors(404))
async def retrieve(file_id: str, svc: ServicesDep, tenant: TenantDep):
    require_id("file", file_id, "file_id")
    async with svc.db.connect() as conn:
        row = await batch_store.get_file(conn, file_id, tenant)
    if row is None:
        raise not_found("file", file_id, "file_id")
    return file_object(row)


@router.get("/{file_id}/content", operation_id="downloadFile", response_class=StreamingResponse,
            responses=_CONTENT | errors(404))
async def content(file_id: str, svc: ServicesDep, tenant: TenantDep):
    require_id("file", file_id, "file_id")
    async with svc.db.connect() as conn:
        row = await batch_store.get_file(conn, file_id, tenant)
    if row is None:
        raise not_found("file", file_id, "file_id")
    f = await asyncio.to_thread(svc.store.open, row["object_key"])  # on S3, a request

    def chunks():
        with f:
            while data := f.read(_COPY):
                yield data

    # Whatever a tenant uploaded, a browser never renders it as a page of this origin.
    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"Content-Length": str(row["bytes"]), "X-Content-Type-Options": "nosniff",
                                      "Content-Disposition": "attachment"})
