"""``python -m trainer run SPEC.json`` (and ``python -m trainer models ...``)."""

from trainer.cli import main

if __name__ == "__main__":
    main()
