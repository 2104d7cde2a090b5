"""celery_lease.config: every rule of the ``lease_*`` settings and their resolution."""

from __future__ import annotations

import dataclasses

import pytest
from celery import Celery

from celery_lease import LeaseTask, config
from celery_lease.errors import LeaseConfigError, LeaseConfigErrors
from celery_lease.masking import MASK
from celery_lease.vocabulary import Decision, OnLost

# One value per setting that its rule rejects. test_every_setting_has_a_bad_value
# keeps this table complete when a setting is added.
BAD_VALUES = {
    "lease_store_url": "",
    "lease_table_prefix": "1-bad prefix",
    "lease_sqlite_busy_timeout": -1,
    "lease_sqlite_synchronous": "OFF",  # a power loss could corrupt the file, not just lose commits
    "lease_store_engine_options": ["poolclass"],
    "lease_store_retry_delay": 0,
    "lease_store_retry_max": -1,
    "lease_clock_tolerance": -0.5,
    "lease_claim_async_commit": "yes",
    "lease_publish_async_commit": 1,
    "lease_audit_every_transition": "true",
    "lease_group_commit": "yes",
    "lease_duration": "30s",
    "lease_heartbeat_interval": 0,
    "lease_grace_period": -0.5,
    "lease_max_runtime": -5,
    "lease_on_lost": "ignore",
    "lease_max_attempts": 0,
    "lease_max_expirations": 1.5,
    "lease_on_expired": "explode",
    "lease_backoff_base": None,
    "lease_backoff_max": -1,
    "lease_backoff_jitter": "yes",
    "lease_dead_letter_queue": "",
    "lease_dispatch_timeout": 0.0,
    "lease_dispatch_backoff_max": 0,
    "lease_reaper_batch_size": True,
    "lease_reaper_hard_grace": "2m",
    "lease_reaper_lock_ttl": 0,
    "lease_worker_stale_after": 0,
    "lease_retention": -1,
    "lease_idempotency_retention": 0,
    "lease_queue_policies": [("reports", {"lease_duration": 600})],
    "lease_extend_visibility": 1,
    "lease_eager_store": "yes",
    "lease_rabbitmq_consumer_timeout": 0,
    "lease_runbook_base_url": "wiki/celery-lease#playbook",
    "lease_lock_ttl": 0,
    "lease_lock_timeout": -1,
    "lease_web_token": "",
    "lease_web_basic_auth": "admin",  # no password
    "lease_fault_injector": "tests.faults.injector",  # no attribute after a colon
    "lease_web_show_arguments": "yes",
    "lease_database": "",
}


def make_app(**settings) -> Celery:
    app = Celery("test_config", set_as_current=False)
    app.conf.update(settings)
    return app


def test_every_setting_has_a_bad_value_in_this_module():
    assert set(BAD_VALUES) == {s.name for s in config.SETTINGS}


def test_defaults_load_without_any_lease_setting():
    cfg = config.app_config(make_app())
    for setting in config.SETTINGS:
        assert cfg.values[setting.name] == setting.default, setting.name


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_value_is_rejected_naming_setting_value_and_rule(name):
    value = BAD_VALUES[name]
    rule = config.BY_NAME[name].rule

    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(**{name: value}))

    err = info.value
    shown = MASK if name in config.SECRETS else value  # a credential never shows, not even a bad one
    assert err.setting == name
    assert err.value == shown
    assert name in str(err)
    assert repr(shown) in str(err)
    assert rule in str(err)


@pytest.mark.parametrize("name", config.SECRETS)
def test_a_bad_credential_setting_is_refused_without_showing_it(name):
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(**{name: 12345678}))

    assert "12345678" not in str(info.value) and info.value.value == MASK


def test_web_basic_auth_takes_user_colon_password():
    cfg = config.app_config(make_app(lease_web_basic_auth="ops:pa:ss"))
    assert cfg.web_basic_auth == "ops:pa:ss"
    for bad in (":secret", "ops:", "ops"):
        with pytest.raises(LeaseConfigError, match="user:password"):
            config.app_config(make_app(lease_web_basic_auth=bad))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("lease_duration", 0.5),
        ("lease_duration", 600),
        ("lease_grace_period", 0),
        ("lease_max_runtime", None),
        ("lease_max_runtime", 3600),
        ("lease_on_lost", "flag"),
        ("lease_on_expired", "dead_letter"),
        ("lease_max_attempts", 1),
        ("lease_backoff_jitter", False),
        ("lease_dead_letter_queue", "dead"),
        ("lease_table_prefix", ""),
        ("lease_table_prefix", "shop_lease_"),
        ("lease_store_url", "postgresql+psycopg://db/shop"),
    ],
)
def test_good_value_is_accepted(name, value):
    cfg = config.app_config(make_app(**{name: value, "lease_heartbeat_interval": 0.1}))
    assert cfg.values[name] == value


def test_policy_values_resolve_to_vocabulary_members_from_their_strings():
    cfg = config.app_config(make_app(lease_on_lost="flag", lease_on_expired="dead_letter"))
    policy = cfg.policy({"lease_on_lost": "raise"}, where="task t.work")
    assert cfg.on_lost is OnLost.FLAG and cfg.on_expired is Decision.DEAD_LETTER
    assert policy.on_lost is OnLost.RAISE and policy.on_expired is Decision.DEAD_LETTER
    with pytest.raises(LeaseConfigError, match="lease_on_lost='ignore' is invalid: must be one of 'raise', "):
        config.app_config(make_app(lease_on_lost="ignore"))


def test_integer_durations_become_floats():
    cfg = config.app_config(make_app(lease_duration=60, lease_heartbeat_interval=20))
    assert isinstance(cfg.duration, float) and cfg.duration == 60.0


def test_unknown_lease_key_is_rejected_listing_the_valid_keys():
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(lease_frobnicate=60))

    message = str(info.value)
    assert info.value.setting == "lease_frobnicate"
    assert "unknown" in message
    for setting in config.SETTINGS:
        assert setting.name in message


def test_a_misspelled_setting_is_named_as_written_with_the_closest_valid_name():
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(lease_duraton=60))

    assert info.value.setting == "lease_duraton"
    assert "Did you mean lease_duration?" in str(info.value)
    assert config.fix_for(info.value) == "rename lease_duraton to lease_duration"


def test_heartbeat_interval_above_a_third_of_the_duration_is_rejected():
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(lease_duration=30, lease_heartbeat_interval=10.5))

    assert info.value.setting == "lease_heartbeat_interval"
    assert "third of lease_duration" in str(info.value)


def test_heartbeat_interval_of_exactly_a_third_is_accepted():
    cfg = config.app_config(make_app(lease_duration=30, lease_heartbeat_interval=10))
    assert cfg.heartbeat_interval == 10.0


def test_default_duration_shorter_than_three_default_heartbeats_is_rejected():
    # Only lease_duration is set; the default heartbeat (10 s) no longer fits.
    with pytest.raises(LeaseConfigError, match="lease_heartbeat_interval"):
        config.app_config(make_app(lease_duration=20))


def test_backoff_max_below_backoff_base_is_rejected():
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(lease_backoff_base=10, lease_backoff_max=5))
    assert info.value.setting == "lease_backoff_max"


def test_store_retry_max_below_the_store_retry_delay_is_rejected_for_the_app_and_for_a_task():
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(lease_store_retry_delay=10, lease_store_retry_max=5))
    assert info.value.setting == "lease_store_retry_max"
    with pytest.raises(LeaseConfigError, match="lease_store_retry_delay"):
        config.app_config(make_app()).policy({"lease_store_retry_delay": 600.0}, where="task t")


def test_app_config_is_built_once_and_cached_on_the_app():
    app = make_app(lease_duration=60, lease_heartbeat_interval=5)
    assert config.app_config(app) is config.app_config(app)


def test_app_config_is_frozen():
    cfg = config.app_config(make_app())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.values = {}  # type: ignore[misc]


# -- resolution: task option > queue policy > app setting > default ----------------
def policy_app(**settings) -> Celery:
    app = make_app(**settings)

    @app.task(shared=False, name="plain")
    def plain():
        return None

    @app.task(shared=False, name="overridden", lease_duration=90.0, lease_max_attempts=9)
    def overridden():
        return None

    return app


def test_default_applies_when_nothing_sets_an_option():
    app = policy_app()
    policy = config.task_policy(app.tasks["plain"])
    assert policy.duration == config.BY_NAME["lease_duration"].default
    assert policy.max_attempts == config.BY_NAME["lease_max_attempts"].default


def test_app_setting_overrides_the_default():
    app = policy_app(lease_duration=45, lease_heartbeat_interval=5)
    assert config.task_policy(app.tasks["plain"]).duration == 45.0


def test_queue_policy_overrides_the_app_setting():
    app = policy_app(
        lease_duration=45, lease_heartbeat_interval=5,
        lease_queue_policies={"reports": {"lease_duration": 600}},
    )
    assert config.task_policy(app.tasks["plain"], queue="reports").duration == 600.0
    assert config.task_policy(app.tasks["plain"], queue="default").duration == 45.0
    assert config.task_policy(app.tasks["plain"]).duration == 45.0


def test_task_option_overrides_the_queue_policy():
    app = policy_app(
        lease_duration=45, lease_heartbeat_interval=5,
        lease_queue_policies={"reports": {"lease_duration": 600, "lease_max_attempts": 2}},
    )
    policy = config.task_policy(app.tasks["overridden"], queue="reports")
    assert policy.duration == 90.0
    assert policy.max_attempts == 9


def test_options_a_layer_does_not_set_fall_through_to_the_layer_below():
    app = policy_app(lease_grace_period=3, lease_queue_policies={"reports": {"lease_backoff_base": 2}})
    policy = config.task_policy(app.tasks["overridden"], queue="reports")
    assert (policy.duration, policy.backoff_base, policy.grace_period) == (90.0, 2.0, 3.0)


def test_task_time_limit_becomes_the_default_max_runtime():
    app = make_app()

    @app.task(shared=False, name="limited", time_limit=120)
    def limited():
        return None

    assert config.task_policy(app.tasks["limited"]).max_runtime == 120.0


def test_app_wide_task_time_limit_becomes_the_default_max_runtime():
    app = make_app(task_time_limit=300)

    @app.task(shared=False, name="unlimited")
    def unlimited():
        return None

    assert config.task_policy(app.tasks["unlimited"]).max_runtime == 300.0


def test_policy_as_settings_round_trips_every_per_task_option():
    policy = config.app_config(make_app()).policy()
    assert set(policy.as_settings()) == set(config.PER_TASK)


def test_bad_task_option_is_rejected_naming_the_task():
    app = make_app()

    @app.task(shared=False, name="shop.capture", lease_duration="ten")
    def capture():
        return None

    with pytest.raises(LeaseConfigError) as info:
        config.task_policy(app.tasks["shop.capture"])
    assert info.value.setting == "lease_duration"
    assert "shop.capture" in str(info.value)


def test_task_option_that_breaks_the_heartbeat_rule_is_rejected():
    app = make_app()

    @app.task(shared=False, name="short", lease_duration=6)
    def short():
        return None

    with pytest.raises(LeaseConfigError, match=r"lease_heartbeat_interval.*task short"):
        config.task_policy(app.tasks["short"])


def test_app_wide_option_passed_as_task_override_is_rejected():
    cfg = config.app_config(make_app())
    with pytest.raises(LeaseConfigError) as info:
        cfg.policy({"lease_reaper_batch_size": 5}, where="task shop.capture")

    assert info.value.setting == "lease_reaper_batch_size"
    assert "not a per-task lease option" in str(info.value)
    assert "lease_duration" in str(info.value)  # lists the per-task options


def test_app_wide_option_in_a_queue_policy_is_rejected_at_load():
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(lease_queue_policies={"reports": {"lease_store_url": "sqlite://"}}))
    assert info.value.setting == "lease_store_url"
    assert "reports" in str(info.value)


def test_bad_value_in_a_queue_policy_is_rejected_at_load():
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(lease_queue_policies={"reports": {"lease_duration": -1}}))
    assert info.value.setting == "lease_duration"
    assert "lease_queue_policies['reports']" in str(info.value)


def test_queue_policy_that_is_not_a_mapping_is_rejected():
    with pytest.raises(LeaseConfigError, match="lease_queue_policies"):
        config.app_config(make_app(lease_queue_policies={"reports": 600}))


def test_app_wide_option_set_on_a_task_is_rejected():
    app = make_app()

    @app.task(shared=False, name="batchy", lease_reaper_batch_size=5)
    def batchy():
        return None

    with pytest.raises(LeaseConfigError) as info:
        config.task_policy(app.tasks["batchy"])
    assert info.value.setting == "lease_reaper_batch_size"
    assert "batchy" in str(info.value)


def test_a_misspelled_task_option_is_refused_with_the_closest_name_not_ignored():
    app = make_app()

    @app.task(shared=False, name="slow", lease_durration=600)
    def slow():
        return None

    with pytest.raises(LeaseConfigError) as info:
        config.task_policy(app.tasks["slow"])
    assert (info.value.setting, info.value.value) == ("lease_durration", 600)
    assert "task slow" in str(info.value) and "Did you mean lease_duration?" in str(info.value)

    @app.task(shared=False, name="odd", lease_colour="blue")
    def odd():
        return None

    with pytest.raises(LeaseConfigError, match=r"lease_colour.*task odd.*Task options: lease_"):
        config.task_policy(app.tasks["odd"])


def test_a_method_or_property_named_lease_of_the_apps_own_task_class_is_not_an_option():
    app = make_app()

    class Reporting(LeaseTask):
        abstract = True

        def lease_summary(self) -> str:
            return "summary"

        @property
        def lease_owner(self) -> str:
            return "me"

    @app.task(base=Reporting, shared=False, name="reporting")
    def reporting():
        return None

    assert config.task_policy(app.tasks["reporting"]).duration == 30.0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["lease_duration", "lease_grace_period", "lease_lock_timeout",
                                  "lease_max_runtime", "lease_reaper_hard_grace"])
def test_a_duration_that_is_not_a_finite_number_is_refused(name, value):
    # NaN compares false with everything: a NaN grace was stored and the reaper never took the lease back.
    with pytest.raises(LeaseConfigError) as info:
        config.app_config(make_app(**{name: value}))
    assert info.value.setting == name


# -- Django-style namespaced settings ------------------------------------------------
class DjangoSettings:
    CELERY_BROKER_URL = "memory://"
    CELERY_LEASE_DURATION = 60
    CELERY_LEASE_HEARTBEAT_INTERVAL = 5
    CELERY_LEASE_STORE_URL = "postgresql+psycopg://db/shop"


def namespaced_app(settings: type) -> Celery:
    app = Celery("django_like", set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")
    return app


def test_namespaced_settings_are_read():
    cfg = config.app_config(namespaced_app(DjangoSettings))
    assert cfg.duration == 60.0
    assert cfg.heartbeat_interval == 5.0
    assert cfg.store_url == "postgresql+psycopg://db/shop"


def test_bad_namespaced_setting_is_rejected_under_its_lease_name():
    class Bad(DjangoSettings):
        CELERY_LEASE_MAX_ATTEMPTS = 0

    with pytest.raises(LeaseConfigError) as info:
        config.app_config(namespaced_app(Bad))
    assert info.value.setting == "lease_max_attempts"


def test_unknown_namespaced_lease_setting_is_named_as_django_spells_it():
    class Typo(DjangoSettings):
        CELERY_LEASE_DURATON = 60

    with pytest.raises(LeaseConfigError) as info:
        config.app_config(namespaced_app(Typo))
    assert info.value.setting == "CELERY_LEASE_DURATON"
    assert str(info.value).startswith("CELERY_LEASE_DURATON=60 is invalid: unknown celery_lease setting")
    assert "Did you mean CELERY_LEASE_DURATION?" in str(info.value)
    assert config.fix_for(info.value) == "rename CELERY_LEASE_DURATON to CELERY_LEASE_DURATION"


def test_every_bad_setting_is_reported_at_once():
    class Typos(DjangoSettings):
        CELERY_LEASE_DURATON = 60
        CELERY_LEASE_HEARTBEAT_INTERVL = 5
        CELERY_LEASE_MAX_ATTEMPTS = 0

    with pytest.raises(LeaseConfigErrors) as info:
        config.app_config(namespaced_app(Typos))
    problems = config.problems_of(info.value)
    assert [p.setting for p in problems] == ["CELERY_LEASE_DURATON", "CELERY_LEASE_HEARTBEAT_INTERVL",
                                             "lease_max_attempts"]
    assert info.value.setting == "CELERY_LEASE_DURATON"  # the first problem's
    assert "Set as CELERY_LEASE_MAX_ATTEMPTS" in str(problems[2])
    assert [config.fix_for(p) for p in problems] == [
        "rename CELERY_LEASE_DURATON to CELERY_LEASE_DURATION",
        "rename CELERY_LEASE_HEARTBEAT_INTERVL to CELERY_LEASE_HEARTBEAT_INTERVAL",
        "set lease_max_attempts to an integer >= 1"]
    for problem in problems:
        assert str(problem) in str(info.value)


def test_shortest_lease_takes_the_least_of_setting_queue_policies_and_task_options():
    cfg = config.app_config(make_app(lease_duration=30.0, lease_heartbeat_interval=1.0,
                                     lease_queue_policies={"fast": {"lease_duration": 12.0}}))

    class Task:
        lease_duration = 6.0

    class Plain:
        lease_duration = None

    assert config.shortest_lease(cfg) == 12.0
    assert config.shortest_lease(cfg, [Task(), Plain()]) == 6.0


def test_idempotency_keys_must_outlive_the_jobs_they_name():
    rule = r"lease_idempotency_retention=3600.0 is invalid: must be at least lease_retention \(7200s\)"
    with pytest.raises(LeaseConfigError, match=rule):
        config.load({"lease_retention": 7200.0, "lease_idempotency_retention": 3600.0})


# -- worker liveness ------------------------------------------------------------------
def stale_app(**conf):
    app = Celery(f"stale_{id(conf)}", set_as_current=False)
    app.conf.update(lease_store_url="sqlite://", **conf)
    return app


def test_stale_after_is_derived_from_the_default_lease_within_the_recovery_bound():
    # lease 30 + grace 10 - one 10 s heartbeat; at least three heartbeats (30)
    assert config.worker_stale_after(stale_app()) == 30.0


def test_stale_after_keeps_three_of_the_longest_heartbeats_of_every_policy_and_task():
    from celery_lease import LeaseTask

    slow_queue = {"lease_duration": 600.0, "lease_heartbeat_interval": 60.0}
    app = stale_app(lease_queue_policies={"slow": slow_queue})
    assert config.worker_stale_after(app) == 180.0  # never stale between two heartbeats of the slow queue

    quick = stale_app(lease_duration=6.0, lease_heartbeat_interval=1.0, lease_grace_period=1.0)
    assert config.worker_stale_after(quick) == 6.0

    @quick.task(base=LeaseTask, shared=False, name="t.slow", lease_duration=30.0,
                lease_heartbeat_interval=2.0)
    def slow():  # pragma: no cover - never called
        return None

    assert config.worker_stale_after(quick) == 6.0  # max(3 x 2, min(7, 40) - 2)


def test_an_explicit_stale_after_past_the_recovery_bound_is_refused_with_the_numbers():
    app = stale_app(lease_worker_stale_after=60.0)
    rule = r"lease_worker_stale_after=60.0 is invalid: must be at most the shortest lease_duration \+ "
    with pytest.raises(LeaseConfigError, match=rule + r"lease_grace_period \(40s\)"):
        config.check_recovery_bound(app)
    config.check_recovery_bound(stale_app(lease_worker_stale_after=40.0))
    assert config.worker_stale_after(stale_app(lease_worker_stale_after=40.0)) == 40.0


def test_a_store_on_both_a_database_alias_and_a_url_is_refused_naming_both():
    with pytest.raises(LeaseConfigError, match=r"lease_database='default' is invalid: is set together with "
                                               r"lease_store_url.*Remove lease_store_url"):
        config.app_config(make_app(lease_database="default", lease_store_url="sqlite:///x.sqlite3"))
    assert config.app_config(make_app(lease_database="default")).database == "default"
