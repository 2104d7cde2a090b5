"""The reaper: run_once(now) -> ReapResult, its decisions, a lost child's job (imports core, store/,
messaging/ only; never worker/ or publish/)."""

from .run import Reaper, ReapResult, reap

__all__ = ["Reaper", "ReapResult", "reap"]
