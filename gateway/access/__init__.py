"""Who may do what, and the record of it: tokens, route policies, staff grants, the audit log.

- ``policy``: the roles each route admits (every route declares one) and the pure
  grant decision for a staff read.
- ``tokens``: API tokens (random, shown once, stored hashed), their provenance,
  minting, rotation and revocation; ``authenticate`` turns a bearer token into a
  :class:`~gateway.access.tokens.Principal`.
- ``staff``: staff access requests, tenant-admin decisions and grant-checked reads.
- ``audit``: the hash-chained, externally anchored audit log every decision above
  appends to.

It may import ``gateway.models``, ``gateway.db``, ``gateway.config``,
``gateway.errors`` and ``gateway.storage`` (a granted staff read goes through the
broker); never a front end (``api``, ``portal``, the CLIs) or ``gateway.slurm``.
Its ``tokens`` and ``staff`` modules are service modules: they write the database
with a keyword-only ``session`` like ``gateway.services``.
"""
