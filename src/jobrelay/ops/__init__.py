"""Operator tools: explaining a job, replay and cancel, the quarantine scan."""
