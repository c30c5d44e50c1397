"""The shipped example app: ``report.export`` (an account's ledger for one month, as CSV) and
the ``notify.email`` notification that follows it. Used when no ``--app`` is given."""
