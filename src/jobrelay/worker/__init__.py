"""The worker, in the order a job meets it: ``consumer`` takes deliveries, ``delivery`` claims
one, ``attempt`` runs it under its claim and commits the outcome, then it is settled."""
