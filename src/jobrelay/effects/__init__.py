"""External effects: e-mail over SMTP, and the ``notify.email`` job that sends it once
through the effects ledger."""
