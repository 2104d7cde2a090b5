"""The reaper, its decisions, a lost child's job (imports core, store/, messaging/; not worker/, publish/)."""

from .run import Reaper, ReapResult, reap

__all__ = ["Reaper", "ReapResult", "reap"]
