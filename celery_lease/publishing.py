"""The producer a LeaseTask publishes through: it records the job's message as Celery sends it.

Celery builds the task message and hands it to ``producer.publish``; this wrapper encodes it
there once, exactly as kombu would (serializer, compression, pydantic models, protocol
options), gives the encoded message to the store write of the publish, and then sends those
same bytes. So the stored message is the sent message, and a message Celery can send can
always be recorded. The store write raises to stop the send (a duplicate idempotency key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import messages

__all__ = ["RecordingProducer"]


class RecordingProducer:
    """Wraps a kombu producer for one ``apply_async``; everything but the task's publish passes through."""

    def __init__(self, producer: Any, task_id: str, record: Callable[[str], None]) -> None:
        self._producer = producer
        self._task_id = task_id
        self._record = record
        self._recorded = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        headers = kwargs.get("headers")
        # The same producer also sends the task-sent event, and Celery retries a refused
        # callback publish through it: only the task's own message is recorded, once.
        if self._recorded or not headers or headers.get("id") != self._task_id:
            return self._producer.publish(body, **kwargs)
        producer = self._producer
        compression = kwargs.pop("compression", None)
        compression = producer.compression if compression is None else compression
        data, content_type, content_encoding = producer._prepare(
            body, kwargs.pop("serializer", None), kwargs.pop("content_type", None),
            kwargs.pop("content_encoding", None), compression, headers)
        self._record(messages.capture(data, content_type, content_encoding, kwargs))
        self._recorded = True
        # Already encoded and compressed: kombu sends the bytes as they are.
        return producer.publish(data, content_type=content_type, content_encoding=content_encoding,
                                compression="", **kwargs)
