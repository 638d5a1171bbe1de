"""Result stores behind one interface: SQLite (embedded default) and PostgreSQL."""

from mmpipe.store.base import Final, JobRecord, ResultStore, StoreUnavailable, open_store

__all__ = ["Final", "JobRecord", "ResultStore", "StoreUnavailable", "open_store"]
