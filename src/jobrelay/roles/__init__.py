"""The processes' roles: the worker (and one claimed attempt), the relay, the reconciler,
and the wiring that builds a runtime from settings."""
