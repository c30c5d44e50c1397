"""A running process's wiring: the adapters picked from settings, and its heartbeat."""
