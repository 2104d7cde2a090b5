"""``manage.py lease_schedule_reaper``."""
