"""Operator tools: explaining a job, listing jobs, replay and cancel, schedules, the
quarantine purge; shared by the CLI and the admin HTTP API."""
