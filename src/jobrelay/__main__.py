"""``python -m jobrelay``: the same as the ``jobrelay`` command."""

from jobrelay.cli.entry import main

main()
