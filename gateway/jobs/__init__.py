"""A job's life: the one state machine (``state``), submission to the scheduler
(``submission``), the reconciler loop (``reconciler``) and the publication checks
(``publish``). The services (``gateway.services.job*``, ``progress``, ``publication``,
``recovery``) hold the database writes these call. ``state`` is pure and imports nothing of
the gateway; the others may import config, models, services, storage and the Slurm adapter,
never the front ends.
"""
