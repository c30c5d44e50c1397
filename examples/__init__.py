"""Runnable examples for the docs; each one is quoted by a tutorial and run by a test."""
