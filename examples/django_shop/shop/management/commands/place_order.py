"""``manage.py place_order ITEM [--decline]``: prints ``order ID job ID``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from examples.django_shop.shop.orders import PaymentDeclined, place_order


class Command(BaseCommand):
    help = "Place an order; its shipping job is enqueued in the same transaction."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("item")
        parser.add_argument("--decline", action="store_true", help="fail inside atomic()")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            order_id, job_id = place_order(options["item"], decline=options["decline"])
        except PaymentDeclined as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"order {order_id} job {job_id}")
