"""celery_lease.clock: the store's now() on every dialect, with sub-second precision."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from celery_lease import clock
from celery_lease.errors import LeaseConfigError
from celery_lease.store import Store
from tests.helpers import wait_for


def test_store_now_is_close_to_this_machines_clock(store):
    # The services run on this machine, so the two clocks agree closely.
    before = time.time()
    now = store.now()
    after = time.time()
    assert before - 1.0 <= now <= after + 1.0


def test_two_reads_of_the_store_clock_differ_by_less_than_a_second(store):
    first = store.now()
    second = store.now()
    assert 0 <= second - first < 1.0


def test_store_clock_has_sub_second_precision(store):
    # One read could land on a whole second by chance; five cannot all do so.
    reads = [store.now() for _ in range(5)]
    assert any(r != int(r) for r in reads), reads


def test_store_clock_advances_inside_one_transaction(store):
    # A long transaction must not freeze time (PostgreSQL's now() would).
    with store.begin() as conn:
        first = conn.execute(sa.select(store.now_sql)).scalar_one()
        wait_for(
            lambda: conn.execute(sa.select(store.now_sql)).scalar_one() > first,
            timeout=2.0, interval=0.01, message="store clock did not advance inside a transaction",
        )


@pytest.mark.parametrize("dialect", clock.SUPPORTED_DIALECTS)
def test_every_supported_dialect_has_a_clock_expression(dialect):
    expression = clock.now(dialect)
    assert isinstance(expression.type, sa.Double)


def test_unsupported_dialect_is_rejected_naming_it():
    with pytest.raises(ValueError, match="'oracle'"):
        clock.now("oracle")


def test_store_on_an_unsupported_dialect_is_a_config_error():
    with pytest.raises(LeaseConfigError) as info:
        Store("oracle://scott:tiger@127.0.0.1/orcl")
    assert info.value.setting == "lease_store_url"
    assert "oracle" in str(info.value)
