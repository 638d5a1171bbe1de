"""Result stores behind one interface: SQLite (embedded default) and PostgreSQL."""

from mmpipe.stages.sink.store.base import Final, JobRecord, ResultStore, StoreUnavailable, count_results, open_store

__all__ = ["Final", "JobRecord", "ResultStore", "StoreUnavailable", "count_results", "open_store"]
