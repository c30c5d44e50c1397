"""``python -m jobrelay``: the same as the ``jobrelay`` command."""

from jobrelay.cli.main import main

main()
