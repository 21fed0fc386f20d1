"""``python -m trainer run SPEC.json`` (and ``python -m trainer models ...``)."""

from trainer import early_signals

early_signals.capture()  # before the slow imports below

from trainer.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
