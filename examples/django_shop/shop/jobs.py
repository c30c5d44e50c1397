"""The jobrelay App of the shop: ``jobrelay up --app examples.django_shop.shop.jobs:app``
with ``JOBRELAY_DATABASE_URL`` set to the shop's database."""

from __future__ import annotations

from pydantic import BaseModel

import jobrelay

app = jobrelay.App()


class Ship(BaseModel):
    order_id: int


@app.job("shop.ship", params=Ship, max_attempts=5)
def ship(ctx: jobrelay.SyncJobContext[Ship], params: Ship) -> jobrelay.Result:
    """A plain ``def`` job, as Django code is synchronous: it runs in the worker's threads."""
    ctx.log.info("shipping order %d", params.order_id)
    return jobrelay.Result(meta={"shipped": params.order_id})
