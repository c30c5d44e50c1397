"""Everything that speaks SQL: the tables, the engine, and the named queries in ``store``."""
