"""Checks, tuning, metrics, recovery verbs (imports every layer below it; cli/ and web/ import it)."""
