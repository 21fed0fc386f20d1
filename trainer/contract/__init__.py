"""The contract between the gateway and the trainer: the one place both sides read.

Pure code (the standard library and pydantic, nothing of ``gateway/`` and nothing heavy of
``trainer/``), so the gateway imports it without torch and a compute node runs it without
the gateway. What the gateway writes and the trainer reads is defined here once:

- ``spec``: the job spec (``JobSpec``, its hyperparameters, their defaults and ranges);
- ``lines``: the JSONL line grammar of uploaded datasets (chat and preference lines);
- ``exitcodes``: what a trainer process's exit status means;
- ``jobdir``: the names of the files and folders of a job directory.
- ``errors``: the trainer's exception hierarchy (the validators above raise it; each class maps
  to an exit code).
"""
