"""Transports move messages between the relay and the workers: RabbitMQ, or the local one."""
