"""The OpenAI Files and Batch API on the edge, as a Quart Blueprint.

The edge only records: uploads, new batches, cancellation requests. Running a batch is the
worker's job (``iop_trio/worker``), a separate process sharing the edge's database and files
directory, so the blueprint opens its own :class:`~iop_trio.store.batches.BatchStore` on the
edge's ``data_dir`` while the app serves.

Uploads are bounded by the app's ``MAX_CONTENT_LENGTH`` (``http.max_body_size``): a larger body
is answered 413 before it is read.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, Response, current_app, request
from werkzeug.exceptions import RequestEntityTooLarge

from ..config import EdgeConfig
from ..store.batches import Batch, BatchStore, FileRecord, UnknownCursor
from .errors import ApiError, error_body
from .openai_requests import parse_json_object

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}
UPLOAD_PURPOSES = ("batch",)
METADATA_MAX_KEYS, METADATA_KEY_LENGTH, METADATA_VALUE_LENGTH = 16, 64, 512
CHUNK_SIZE = 64 * 1024


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def json_response(body: Any) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), content_type="application/json")


def timestamp(value: float | None) -> int | None:
    return None if value is None else int(value)


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": int(record.created_at),
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_object(batch: Batch) -> dict[str, Any]:
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at),
        "in_progress_at": timestamp(batch.in_progress_at),
        "expires_at": timestamp(batch.expires_at),
        "finalizing_at": timestamp(batch.finalizing_at),
        "completed_at": timestamp(batch.completed_at),
        "failed_at": timestamp(batch.failed_at),
        "expired_at": timestamp(batch.expired_at),
        "cancelling_at": timestamp(batch.cancelling_at),
        "cancelled_at": timestamp(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata,
    }


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def query_limit(default: int, maximum: int) -> int:
    raw = request.args.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= maximum:
        raise invalid(f"Invalid 'limit': expected an integer between 1 and {maximum}.", "limit")
    return int(raw)


def metadata_of(body: dict[str, Any]) -> dict[str, str] | None:
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > METADATA_MAX_KEYS
        or not all(isinstance(k, str) and len(k) <= METADATA_KEY_LENGTH for k in metadata)
        or not all(isinstance(v, str) and len(v) <= METADATA_VALUE_LENGTH for v in metadata.values())
    ):
        raise invalid(
            f"Invalid 'metadata': at most {METADATA_MAX_KEYS} string keys of up to {METADATA_KEY_LENGTH} "
            f"characters with string values of up to {METADATA_VALUE_LENGTH}.",
            "metadata",
        )
    return metadata


def required_choice(body: dict[str, Any], name: str, choices: Any) -> str:
    value = body.get(name)
    if value is None:
        raise invalid(f"Missing required parameter: '{name}'.", name)
    if value not in choices:
        listed = ", ".join(f"'{choice}'" for choice in choices)
        raise invalid(f"Invalid value for '{name}': {value!r}. Supported values are: {listed}.", name)
    return str(value)


def batch_blueprint(config: EdgeConfig) -> Blueprint:
    """Files and Batches routes over the store in ``config.data_dir`` (opened while serving)."""
    blueprint = Blueprint("batches", __name__)
    stores: list[BatchStore] = []

    @blueprint.before_app_serving
    async def open_store() -> None:
        stores.append(BatchStore.for_data_dir(config.data_dir))

    @blueprint.after_app_serving
    async def close_store() -> None:
        stores.pop().close()

    def store() -> BatchStore:
        return stores[0]

    @blueprint.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        response = json_response(error.body())
        response.status_code = error.status
        response.headers.update(error.headers)
        return response

    @blueprint.errorhandler(RequestEntityTooLarge)
    async def too_large(_error: RequestEntityTooLarge) -> Response:
        limit = current_app.config["MAX_CONTENT_LENGTH"]
        response = json_response(error_body(f"The upload exceeds the limit of {limit} bytes."))
        response.status_code = 413
        # The rest of the body is never read. Hypercorn 0.18 cannot recycle such a connection
        # (it blocks handing the unread body to the finished request), so a client that reused
        # it would wait forever: make it open a new one.
        response.headers["Connection"] = "close"
        return response

    async def find_file(file_id: str) -> FileRecord:
        record = await store().get_file(file_id)
        if record is None:
            raise file_not_found(file_id)
        return record

    async def find_batch(batch_id: str) -> Batch:
        batch = await store().get_batch(batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        return batch

    @blueprint.post("/v1/files")
    async def upload_file() -> Response:
        if request.mimetype != "multipart/form-data":
            raise invalid("Expected a multipart/form-data body with 'file' and 'purpose'.")
        form, files = await request.form, await request.files
        purpose = form.get("purpose")
        if not purpose:
            raise invalid("Missing required parameter: 'purpose'.", "purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise invalid(f"Invalid value for 'purpose': {purpose!r}. Supported values are: 'batch'.", "purpose")
        upload = files.get("file")
        if upload is None:
            raise invalid("Missing required parameter: 'file'.", "file")
        record = await store().save_upload(upload.stream, upload.filename or "upload.jsonl", purpose, time.time())
        if record.bytes == 0:
            await store().delete_file(record.id)
            raise invalid("The file is empty.", "file")
        return json_response(file_object(record))

    @blueprint.get("/v1/files")
    async def list_files() -> Response:
        order = request.args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("Invalid 'order': expected 'asc' or 'desc'.", "order")
        try:
            records, more = await store().list_files(
                purpose=request.args.get("purpose"),
                after=request.args.get("after"),
                limit=query_limit(10_000, 10_000),
                ascending=order == "asc",
            )
        except UnknownCursor as exc:
            raise invalid(f"Invalid 'after': no file {exc.args[0]!r}.", "after") from exc
        return json_response(page([file_object(record) for record in records], more))

    @blueprint.get("/v1/files/<file_id>")
    async def retrieve_file(file_id: str) -> Response:
        return json_response(file_object(await find_file(file_id)))

    @blueprint.delete("/v1/files/<file_id>")
    async def delete_file(file_id: str) -> Response:
        if not await store().delete_file(file_id):
            raise file_not_found(file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})

    @blueprint.get("/v1/files/<file_id>/content")
    async def file_content(file_id: str) -> Response:
        await find_file(file_id)
        try:
            handle = await trio.open_file(store().path_of(file_id), "rb")
        except FileNotFoundError as exc:
            raise file_not_found(file_id) from exc

        async def chunks() -> AsyncIterator[bytes]:
            async with handle:
                while chunk := await handle.read(CHUNK_SIZE):
                    yield chunk

        response = Response(chunks(), content_type="application/octet-stream")
        response.timeout = None  # a large file to a slow client is not a stuck response
        return response

    @blueprint.post("/v1/batches")
    async def create_batch() -> Response:
        body = parse_json_object(await request.get_data())
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str) or not input_file_id:
            raise invalid("Missing required parameter: 'input_file_id'.", "input_file_id")
        endpoint = required_choice(body, "endpoint", ENDPOINTS)
        window = required_choice(body, "completion_window", COMPLETION_WINDOWS)
        metadata = metadata_of(body)
        record = await store().get_file(input_file_id)
        if record is None:
            raise file_not_found(input_file_id, param="input_file_id")
        if record.purpose != "batch":
            raise invalid(f"File {input_file_id} was not uploaded with purpose 'batch'.", "input_file_id")
        batch = await store().create_batch(
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=window,
            window_seconds=COMPLETION_WINDOWS[window],
            metadata=metadata,
            now=time.time(),
        )
        return json_response(batch_object(batch))

    @blueprint.get("/v1/batches")
    async def list_batches() -> Response:
        try:
            batches, more = await store().list_batches(after=request.args.get("after"), limit=query_limit(20, 100))
        except UnknownCursor as exc:
            raise invalid(f"Invalid 'after': no batch {exc.args[0]!r}.", "after") from exc
        return json_response(page([batch_object(batch) for batch in batches], more))

    @blueprint.get("/v1/batches/<batch_id>")
    async def retrieve_batch(batch_id: str) -> Response:
        return json_response(batch_object(await find_batch(batch_id)))

    @blueprint.post("/v1/batches/<batch_id>/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        batch = await store().cancel_batch(batch_id, time.time())
        if batch is None:
            raise batch_not_found(batch_id)
        if batch.status not in ("cancelling", "cancelled"):
            raise invalid(f"Cannot cancel batch {batch_id}: its status is '{batch.status}'.")
        return json_response(batch_object(batch))

    return blueprint


def file_not_found(file_id: str, param: str = "id") -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", param=param)


def batch_not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
