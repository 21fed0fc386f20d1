"""``python -m gateway`` is the ``finetune`` command."""

from gateway.cli import main

main()
