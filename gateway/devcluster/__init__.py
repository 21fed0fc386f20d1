"""The one-host development cluster: Slurm daemons, MariaDB and slurmdbd on this machine, for the demo and the tests."""
