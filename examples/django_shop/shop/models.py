"""One model: an order, shipped by a jobrelay job enqueued in the same transaction."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)
