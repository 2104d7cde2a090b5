"""Alembic's entry point for the lease store's own migrations, run through ``celery_lease.store.migrations``
(never the ``alembic`` command), which hands over the connection (``--sql``: the URL) and the table prefix."""

from __future__ import annotations

from alembic import context

attributes = context.config.attributes
version_table = attributes["version_table"]

if context.is_offline_mode():
    context.configure(url=attributes["url"], literal_binds=True, version_table=version_table,
                      dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()
else:
    # The caller's connection is already in a transaction: the migration joins it.
    context.configure(connection=attributes["connection"], version_table=version_table)
    with context.begin_transaction():
        context.run_migrations()
