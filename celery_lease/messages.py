"""A job's message as stored in ``jobs.payload``, and its re-publication.

The payload is the Celery signature of the job (task, args, kwargs and the
options that matter on the wire: queue, links, chain, chord, headers) encoded
with the task's own serializer, so the reaper can send the same work again under
the same task id.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import json
from collections.abc import Iterator, Mapping
from typing import Any

from kombu import serialization

from .errors import StoreCorrupt

__all__ = ["encode", "decode", "encode_result", "decode_result", "republish", "publishing_unrecorded",
           "recording_disabled", "PAYLOAD_VERSION"]

PAYLOAD_VERSION = 1

# Options that describe how a call was made in this process, not the message.
_LOCAL_OPTIONS = frozenset({
    "producer", "connection", "publisher", "add_to_parent", "countdown", "eta", "task_id",
    "retry", "retry_policy", "declare", "idempotency_key", "ignore_result_default",
})

_unrecorded: contextvars.ContextVar[bool] = contextvars.ContextVar("celery_lease_unrecorded", default=False)


@contextlib.contextmanager
def publishing_unrecorded() -> Iterator[None]:
    """Publish without recording a job: the row exists already, or the store is down."""
    token = _unrecorded.set(True)
    try:
        yield
    finally:
        _unrecorded.reset(token)


def recording_disabled() -> bool:
    return _unrecorded.get()


def _plain(value: Any) -> Any:
    # kombu Queue/Exchange objects travel as their names.
    name = getattr(value, "name", None)
    if name is not None and type(value).__module__.startswith("kombu"):
        return name
    return value


def encode(task_name: str, args: Any, kwargs: Any, options: Mapping[str, Any],
           serializer: str = "json") -> str:
    """Encode a job's signature for the payload column."""
    sig = {
        "task": task_name,
        "args": list(args or ()),
        "kwargs": dict(kwargs or {}),
        "options": {k: _plain(v) for k, v in options.items() if k not in _LOCAL_OPTIONS and v is not None},
        "subtask_type": None,
        "immutable": False,
    }
    return _envelope(sig, serializer)


def _envelope(value: Any, serializer: str) -> str:
    """``value`` serialized by kombu as a JSON text column (binary serializers in base64)."""
    content_type, encoding, data = serialization.dumps(value, serializer=serializer)
    binary = isinstance(data, bytes)
    return json.dumps({
        "v": PAYLOAD_VERSION,
        "content_type": content_type,
        "content_encoding": encoding,
        "b64": binary,
        "data": base64.b64encode(data).decode() if binary else data,
    })


def decode(payload: str | None, accept: Any = None, job_id: str | None = None) -> dict[str, Any]:
    """The signature dict stored in a payload; StoreCorrupt when it cannot be read."""
    if not payload:
        raise StoreCorrupt(f"job {job_id} has no stored message to re-publish", job_id=job_id)
    try:
        sig = _open(payload, accept)
        if not isinstance(sig, dict) or "task" not in sig:
            raise ValueError("not a task signature")
        return sig
    except Exception as exc:  # noqa: BLE001 - any decoding problem means a corrupt row
        raise StoreCorrupt(
            f"job {job_id}: stored message cannot be decoded ({exc}); inspect it with "
            f"`celery lease inspect {job_id}`", job_id=job_id,
        ) from exc


def _open(text: str, accept: Any) -> Any:
    envelope = json.loads(text)
    data = envelope["data"]
    if envelope.get("b64"):
        data = base64.b64decode(data)
    if accept is not None:
        # Celery settings name serializers ('json'); kombu compares MIME types.
        accept = serialization.prepare_accept_content(accept)
    return serialization.loads(data, envelope["content_type"], envelope["content_encoding"], accept=accept)


def encode_result(value: Any, serializer: str) -> str:
    """A task's return value for ``jobs.result``, in the app's result serializer."""
    return _envelope(value, serializer)


def decode_result(text: str, accept: Any, job_id: str) -> Any:
    """The return value a completed job kept; StoreCorrupt when it cannot be read."""
    try:
        return _open(text, accept)
    except Exception as exc:  # noqa: BLE001 - any decoding problem means a corrupt row
        raise StoreCorrupt(f"job {job_id}: kept result cannot be decoded ({exc})", job_id=job_id) from exc


def republish(app: Any, job_id: str, payload: str | None, countdown: float = 0.0,
              queue: str | None = None) -> Any:
    """Send the stored message again under the same task id; returns its AsyncResult."""
    sig = app.signature(decode(payload, app.conf.accept_content, job_id))
    options: dict[str, Any] = {"task_id": job_id}
    if countdown > 0:
        options["countdown"] = countdown
    if queue is not None:
        # The default exchange delivers by queue name: no binding needed, so a broker that
        # restarted empty (Redis without persistence) still gets the message.
        options.update(queue=queue, routing_key=queue, exchange="")
    with publishing_unrecorded():
        return sig.apply_async(**options)
