"""One worker process's side: the run lifecycle, runtime, lease handle, interruption, effects and
locks, broker visibility (imports core, store/, messaging/)."""
