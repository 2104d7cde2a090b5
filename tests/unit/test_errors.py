"""celery_lease.errors: one root, messages a reader can act on, and pickling."""

from __future__ import annotations

import pickle

import pytest

import celery_lease
from celery_lease import errors
from celery_lease.errors import (
    JobNotFound,
    LeaseConfigError,
    LeaseError,
    LeaseLost,
    LockUnavailable,
    StoreCorrupt,
    StoreUnavailable,
)

# One instance of each exception, built the way the library raises it.
EXAMPLES = [
    pytest.param(LeaseError("store exploded", job_id="j-1"), id="LeaseError"),
    pytest.param(LeaseConfigError("lease_duration", -1, "must be a number of seconds > 0"),
                 id="LeaseConfigError"),
    pytest.param(StoreUnavailable(), id="StoreUnavailable"),
    pytest.param(StoreCorrupt("job j-1: checkpoint is not JSON", job_id="j-1"), id="StoreCorrupt"),
    pytest.param(JobNotFound("j-404"), id="JobNotFound"),
    pytest.param(LeaseLost("j-1", reason="token changed", owner="w2@host"), id="LeaseLost"),
    pytest.param(LockUnavailable("invoice:42", 2.5), id="LockUnavailable"),
]


def test_every_public_exception_derives_from_lease_error():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), LeaseError), name


def test_package_exports_every_exception():
    assert set(errors.__all__) <= set(celery_lease.__all__)


def test_the_docstring_tree_names_every_exception():
    for name in errors.__all__:
        assert name in errors.__doc__, name


def test_default_message_is_the_class_docstring():
    assert str(StoreUnavailable()) == StoreUnavailable.__doc__.strip()
    assert str(StoreCorrupt()) == StoreCorrupt.__doc__.strip()
    assert str(LeaseError()) == "celery_lease failed."


def test_config_error_names_setting_value_and_rule():
    err = LeaseConfigError("lease_duration", -1, "must be a number of seconds > 0", "Try 30.")
    assert str(err) == "lease_duration=-1 is invalid: must be a number of seconds > 0. Try 30."
    assert (err.setting, err.value, err.rule) == ("lease_duration", -1, "must be a number of seconds > 0")


def test_config_error_without_hint_ends_with_the_rule():
    assert str(LeaseConfigError("lease_on_lost", "x", "one of 'raise', 'flag'")).endswith("'flag'")


def test_lease_lost_names_job_reason_and_new_owner():
    err = LeaseLost("j-1", reason="token changed", owner="w2@host")
    assert str(err) == "lease on job j-1 lost: token changed (now held by w2@host)"
    assert (err.job_id, err.reason, err.owner) == ("j-1", "token changed", "w2@host")


def test_lease_lost_without_owner_says_only_what_happened():
    assert str(LeaseLost("j-1")) == "lease on job j-1 lost: lost"


def test_job_not_found_names_the_job_and_how_to_list_jobs():
    err = JobNotFound("j-404")
    assert "'j-404'" in str(err)
    assert "celery lease jobs" in str(err)
    assert err.job_id == "j-404"


def test_lock_unavailable_names_resource_and_wait():
    err = LockUnavailable("invoice:42", 2.5)
    assert str(err) == "lock on 'invoice:42' is held by another owner (waited 2.5s)"
    assert (err.resource, err.timeout) == ("invoice:42", 2.5)


def test_store_unavailable_keeps_the_driver_error_as_cause():
    driver = ConnectionRefusedError("connection refused")
    with pytest.raises(StoreUnavailable) as info:
        try:
            raise driver
        except ConnectionRefusedError as exc:
            raise StoreUnavailable("lease store down") from exc
    assert info.value.__cause__ is driver


@pytest.mark.parametrize("error", EXAMPLES)
def test_exception_survives_a_pickle_round_trip(error):
    clone = pickle.loads(pickle.dumps(error))

    assert type(clone) is type(error)
    assert str(clone) == str(error)
    assert clone.args == error.args
    assert clone.context == error.context
    for key, value in error.context.items():
        assert getattr(clone, key) == value


@pytest.mark.parametrize("error", EXAMPLES)
def test_exception_can_be_raised_again_after_unpickling(error):
    clone = pickle.loads(pickle.dumps(error))
    with pytest.raises(type(error), match=r"\w"):
        raise clone


def test_a_refused_statement_is_not_an_outage():
    """An outage is retried until the store answers; a refusal would be refused again, so no
    caller may take it for an outage (and defer the same write for ever)."""
    assert not issubclass(errors.StoreRejected, StoreUnavailable)
    assert issubclass(errors.StoreConflict, errors.StoreRejected)
    assert issubclass(errors.StoreRejected, LeaseError)
    assert issubclass(errors.StoreNotMigrated, StoreUnavailable)
    assert issubclass(errors.SchemaMismatch, StoreUnavailable)
