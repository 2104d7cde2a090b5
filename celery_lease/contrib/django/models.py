"""No models: the module makes Django send this app ``post_migrate`` (it skips an app without one), on which
the lease store catches up with Django's migration records (schema.catch_up)."""
