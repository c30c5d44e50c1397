"""Placing an order: the order row and its shipping job commit together, or neither does."""

from __future__ import annotations

from django.db import connection, transaction

from .jobs import ship
from .models import Order


class PaymentDeclined(Exception):
    pass


def place_order(item: str, *, decline: bool = False) -> tuple[int, str]:
    """The order's id and its job's id. ``connection.connection`` is the psycopg 3 or sqlite3
    connection Django holds; jobrelay writes on it inside ``atomic()`` and never commits."""
    with transaction.atomic():
        order = Order.objects.create(item=item)
        # The order's id as the key: placing the same order twice is one job.
        job_id = ship.enqueue_sync(
            connection.connection, {"order_id": order.id}, key=f"order-{order.id}"
        )
        if decline:  # anything raised inside atomic() rolls back the order AND the job
            raise PaymentDeclined(f"payment for order {order.id} declined")
    return order.id, job_id
