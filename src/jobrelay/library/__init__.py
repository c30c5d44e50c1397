"""The library surface: ``App``, job definitions, their contexts, schedules, the operation
port; ``jobrelay`` re-exports the public names."""
