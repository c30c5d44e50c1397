"""Observability: JSON logs with the job id, Prometheus metrics, fault points for fault tests."""
