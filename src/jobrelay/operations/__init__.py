"""Operations: the business work a job performs. ``report.export`` is the first."""
