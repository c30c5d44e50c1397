"""``python examples/django_shop/manage.py migrate`` (or ``place_order``) from the repository
root; the database is ``DJANGO_SHOP_DATABASE`` (see settings.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
