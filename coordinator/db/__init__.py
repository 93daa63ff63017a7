"""The coordinator's storage: tables (`schema`), typed rows (`rows`), the engine and its transactions (`store`),
and the Alembic migrations that bring any database up to `schema` (`migrations/`)."""
