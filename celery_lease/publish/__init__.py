"""The publish record, group batching, the replace hand-over (imports core, store/, messaging/,
worker/)."""
