"""The code of docs/how-to/use-with-django.md: a Django shop whose order and its shipping job
commit together (``transaction.atomic()``), jobrelay's tables in the same database."""
