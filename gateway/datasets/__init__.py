"""Datasets: a tenant's chat or preference JSONL from the upload stream to a stored, validated file.

``uploads`` streams a multipart body into the tenant's storage (hashing and capping as it
reads), ``validation`` checks every line (pure; one line's checks in ``lines``),
``tokencount`` counts tokens with the base model's tokenizer. ``gateway.services.files``
records the result. May import config, models, storage and services; never the Slurm
adapter or the front ends.
"""
