"""QLoRA trainer that runs inside a Slurm job (standalone: imports nothing from gateway)."""
