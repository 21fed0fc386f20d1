"""A job's life after the API: submission to the scheduler (``submission``), the reconciler loop
(``reconciler``) and the rooms it calls (``expected``, ``watch`` with the pure ``detectors``,
``workers``, ``cleanup``, ``recovery``, ``tenantcalls``, ``loopstats``), the leader lease
(``leader``) and the composition root (``backend``). The services (``gateway.services.job*``,
``progress``, ``publication``, ``recovery``) hold the database writes these call; the state
machine is ``gateway.state``, a leaf. This package may import config, models, services, storage
and the Slurm adapters (through the ``Scheduler`` protocol), never the front ends.
"""
