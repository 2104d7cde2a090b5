"""A job's message as stored in ``jobs.payload`` and its re-publication, the result a completion keeps,
and the header counting a delivery's re-sends while the store was down (the store cannot count then).
Version 2 is the message Celery sent, as kombu encoded it (publishing.py), so the reaper sends the very
same message again; version 1, the job's signature, is what a job first seen at its claim holds."""

from __future__ import annotations

import base64
import contextlib
import datetime
import inspect
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from celery import Task
from celery.app.amqp import AMQP
from celery.app.task import Context
from celery.backends.base import DisabledBackend
from kombu import compression, serialization
from kombu.utils import json as kombu_json

from ..context import UNRECORDED as _unrecorded
from ..errors import StoreCorrupt

__all__ = ["encode", "capture", "decode", "encode_result", "decode_result", "republish",
           "publishing_unrecorded", "recording_disabled", "ignores_result", "has_results", "keepable_result",
           "store_retries", "forget_store_retries", "PAYLOAD_VERSION", "MESSAGE_VERSION",
           "STORE_RETRIES_HEADER"]

log = logging.getLogger(__name__)

PAYLOAD_VERSION = 1
MESSAGE_VERSION = 2

#: The message header that counts a delivery's re-sends while the store was unreachable.
STORE_RETRIES_HEADER = "celery_lease_store_retries"

# Arguments of kombu's publish that say how to send, not what the message is.
_SENDING_ARGS = frozenset({
    "exchange", "routing_key", "retry", "retry_policy", "declare", "headers", "timeout",
    "confirm_timeout", "serializer", "compression", "content_type", "content_encoding",
})

# Options that describe how a call was made in this process, not the message.
_LOCAL_OPTIONS = frozenset({
    "producer", "connection", "publisher", "add_to_parent", "countdown", "eta", "task_id",
    "retry", "retry_policy", "declare", "idempotency_key", "ignore_result_default",
})


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
    return encode_result(sig, serializer)


def encode_result(value: Any, serializer: str) -> str:
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


def capture(data: bytes | str, content_type: str, content_encoding: str,
            publish_kwargs: dict[str, Any]) -> str:
    """The message as kombu sends it (encoded body, headers, properties, route), for the payload."""
    exchange = publish_kwargs.get("exchange")
    return kombu_json.dumps({
        "v": MESSAGE_VERSION,
        "content_type": content_type,
        "content_encoding": content_encoding,
        "b64": isinstance(data, bytes),
        "body": base64.b64encode(data).decode() if isinstance(data, bytes) else data,
        "headers": publish_kwargs.get("headers") or {},
        "properties": {k: _plain(v) for k, v in publish_kwargs.items()
                       if k not in _SENDING_ARGS and v is not None},
        "exchange": _plain(exchange) if exchange is not None else "",
        "routing_key": publish_kwargs.get("routing_key"),
        "declare": [q.name for q in publish_kwargs.get("declare") or () if getattr(q, "name", None)],
    })


def _message(payload: str) -> dict[str, Any] | None:
    """A version 2 payload's envelope, or None for a version 1 payload."""
    envelope = kombu_json.loads(payload)
    return envelope if isinstance(envelope, dict) and envelope.get("v") == MESSAGE_VERSION else None


def _message_signature(envelope: dict[str, Any], accept: Any) -> dict[str, Any]:
    """The signature dict of a sent message (Celery's task protocol 2)."""
    headers, properties = envelope.get("headers") or {}, envelope.get("properties") or {}
    args, kwargs, embed = _loads(envelope, accept, "body", headers.get("compression"))
    embed = embed or {}
    options = {
        "link": embed.get("callbacks"), "link_error": embed.get("errbacks"), "chain": embed.get("chain"),
        "chord": embed.get("chord"), "root_id": headers.get("root_id"), "parent_id": headers.get("parent_id"),
        "group_id": headers.get("group"), "group_index": headers.get("group_index"),
        "ignore_result": headers.get("ignore_result"), "reply_to": properties.get("reply_to"),
        "eta": headers.get("eta"), "expires": headers.get("expires"), "retries": headers.get("retries"),
    }
    return {"task": headers["task"], "args": list(args or ()), "kwargs": dict(kwargs or {}),
            "options": {k: v for k, v in options.items() if v is not None},
            "subtask_type": None, "immutable": False}


def decode(payload: str | None, accept: Any = None, job_id: str | None = None) -> dict[str, Any]:
    """The signature dict stored in a payload; StoreCorrupt when it cannot be read."""
    if not payload:
        raise StoreCorrupt(f"job {job_id} has no stored message to re-publish", job_id=job_id)
    try:
        envelope = _message(payload)
        sig = (_message_signature(envelope, accept) if envelope is not None
               else _loads(json.loads(payload), accept))
        if not isinstance(sig, dict) or "task" not in sig:
            raise ValueError("not a task signature")
        return sig
    except Exception as exc:  # noqa: BLE001 - any decoding problem means a corrupt row
        raise StoreCorrupt(
            f"job {job_id}: stored message cannot be decoded ({exc}); inspect it with "
            f"`celery lease inspect {job_id}`", job_id=job_id,
        ) from exc


def _loads(envelope: dict[str, Any], accept: Any, key: str = "data", algorithm: str | None = None) -> Any:
    """The value an envelope holds under ``key`` (a sent message's ``body``, compressed by ``algorithm``)."""
    data = envelope[key]
    if envelope.get("b64"):
        data = base64.b64decode(data)
    if algorithm:
        data = compression.decompress(data.encode() if isinstance(data, str) else data, algorithm)
    if accept is not None:
        # Celery settings name serializers ('json'); kombu compares MIME types.
        accept = serialization.prepare_accept_content(accept)
    return serialization.loads(data, envelope["content_type"], envelope["content_encoding"], accept=accept)


def decode_result(text: str, accept: Any, job_id: str) -> Any:
    """The return value a completed job kept; StoreCorrupt when it cannot be read."""
    try:
        return _loads(json.loads(text), accept)
    except Exception as exc:  # noqa: BLE001 - any decoding problem means a corrupt row
        raise StoreCorrupt(f"job {job_id}: kept result cannot be decoded ({exc})", job_id=job_id) from exc


def ignores_result(task: Task, request: Any) -> bool:
    """Whether Celery stores no result for this run: the request's own ``ignore_result`` if set, else the
    task's (Celery 5.7's rule, which 5.3 does not export)."""
    explicit = request.__dict__.get("ignore_result") if isinstance(request, Context) else getattr(
        request, "ignore_result", None)
    return bool(explicit if explicit is not None else task.ignore_result)


def has_results(task: Task) -> bool:
    """Whether Celery stores a result for the task's current run."""
    return not (ignores_result(task, task.request) or isinstance(task.backend, DisabledBackend))


def keepable_result(task: Task, value: Any) -> str | None:
    """The return value encoded for the completion to keep; None when Celery stores no result for this run."""
    if not has_results(task):
        return None
    try:
        return encode_result(value, task.app.conf.result_serializer)
    except Exception as exc:  # noqa: BLE001 - Celery's own store_result reports it as the task's failure
        log.warning("job %s: result not kept (%s); a crash before Celery stores it leaves it unstored",
                    task.request.id, exc)
        return None


#: Whether this Celery's messages carry a replacement's replaced_task_nesting (5.3.5 on). Before, every
#: delivery reads 0, and the carrier of a replaced job cannot be told from a copy of the run it replaced.
NESTING_CARRIED = "replaced_task_nesting" in inspect.signature(AMQP.as_task_v2).parameters


def carries_nesting(app: Any) -> bool:
    """Whether the app's messages carry replaced_task_nesting: a Celery that sends it, task protocol 2
    (protocol 1 messages drop it)."""
    return NESTING_CARRIED and int(app.conf.task_protocol or 2) != 1


def nesting_of(payload: str | None) -> int | None:
    """The replaced_task_nesting a stored message carries (0 when it names none); None: it cannot be read."""
    if not payload:
        return None
    try:
        envelope = _message(payload)
        if envelope is not None:
            value = (envelope.get("headers") or {}).get("replaced_task_nesting")
        else:
            # JSON only: a claim never unpickles what it merely compares.
            value = (decode(payload, ("json",)).get("options") or {}).get("replaced_task_nesting")
        return int(value or 0)
    except Exception:  # noqa: BLE001 - a message that cannot be read compares nothing (the claim goes on)
        return None


def store_retries(request: Any) -> int:
    """How many times this delivery's message was sent again because the store was unreachable."""
    value = getattr(request, STORE_RETRIES_HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(STORE_RETRIES_HEADER)
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


def forget_store_retries(request: Any) -> None:
    """The store answered this delivery: a message the run sends again (a retry) counts from zero."""
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        headers.pop(STORE_RETRIES_HEADER, None)


def _envelope_of(payload: str | None) -> dict[str, Any] | None:
    with contextlib.suppress(ValueError):
        return _message(payload) if payload else None
    return None


def check_sendable(app: Any, job_id: str, payload: str | None) -> None:
    """Raise StoreCorrupt, sending nothing, when republish() could not send this stored message: a recovery
    checks it before it moves the row, so a corrupt message leaves the job where it was."""
    envelope = _envelope_of(payload)
    if envelope is not None:
        _read(job_id, envelope)
    else:
        decode(payload, app.conf.accept_content, job_id)


def republish(app: Any, job_id: str, payload: str | None, countdown: float = 0.0,
              queue: str | None = None) -> Any:
    """Send the stored message again under the same task id; returns its AsyncResult."""
    envelope = _envelope_of(payload)
    if envelope is not None:
        return _send_again(app, job_id, envelope, countdown, queue)
    sig = app.signature(decode(payload, app.conf.accept_content, job_id))
    options: dict[str, Any] = {"task_id": job_id}
    if countdown > 0:
        options["countdown"] = countdown
    if queue is not None:
        # The default exchange needs no binding: a broker that restarted empty still gets the message.
        options.update(queue=queue, routing_key=queue, exchange="")
    with publishing_unrecorded():
        return sig.apply_async(**options)


def _read(job_id: str, envelope: dict[str, Any]) -> tuple[dict[str, Any], list[str], Any, str, str,
                                                          dict[str, Any]]:
    """A recorded message's parts (headers, queues to declare, body, content type and encoding, properties);
    StoreCorrupt when they cannot be read back (that job's fault, not the broker's: the reaper fails that
    job and goes on with the others)."""
    try:
        headers = dict(envelope.get("headers") or {})
        names = [str(name) for name in envelope.get("declare") or ()]
        body = envelope["body"]
        if envelope.get("b64"):
            body = base64.b64decode(body, validate=True)
        content_type, content_encoding = str(envelope["content_type"]), str(envelope["content_encoding"])
        properties = {str(k): v for k, v in dict(envelope.get("properties") or {}).items()}
    except (KeyError, TypeError, ValueError) as exc:  # binascii.Error is a ValueError
        raise StoreCorrupt(f"job {job_id}: stored message unreadable ({type(exc).__name__}: {exc})",
                           job_id=job_id) from exc
    if headers.get("id") != job_id or "task" not in headers:
        raise StoreCorrupt(f"job {job_id}: stored message belongs to task id {headers.get('id')!r}",
                           job_id=job_id)
    return headers, names, body, content_type, content_encoding, properties


def _send_again(app: Any, job_id: str, envelope: dict[str, Any], countdown: float, queue: str | None) -> Any:
    """Publish a recorded message's bytes again, as they were sent (a new ETA for a countdown)."""
    headers, names, body, content_type, content_encoding, properties = _read(job_id, envelope)
    if countdown > 0:
        headers["eta"] = (datetime.datetime.now(datetime.timezone.utc)
                          + datetime.timedelta(seconds=countdown)).isoformat()
    exchange, routing_key = envelope.get("exchange") or "", envelope.get("routing_key")
    if queue is not None:
        # The default exchange, for the reason republish() gives.
        exchange, routing_key, names = "", queue, [queue]
    conf = app.conf
    with app.producer_or_acquire() as producer:
        producer.publish(
            body, exchange=exchange, routing_key=routing_key, headers=headers,
            content_type=content_type, content_encoding=content_encoding,
            compression="", declare=_queues(app, names),
            retry=conf.task_publish_retry, retry_policy=conf.task_publish_retry_policy,
            **properties,
        )
    return app.AsyncResult(job_id)


def _queues(app: Any, names: list[str]) -> list[Any]:
    """The app's queue objects to declare with a re-publish (names it does not know are skipped)."""
    queues = app.amqp.queues
    found = []
    for name in names:
        with contextlib.suppress(KeyError):
            found.append(queues[name])
    return found
