"""The relay: outbox rows to the broker, marked published once confirmed."""
