"""All that Celery calls into: LeaseTask, the Request, signals, the strategy (imports every layer below
it)."""
