"""Command line of the prolog/epilog program (argparse: nothing else to install on nodes)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from scrubber.config import DEFAULT_CONFIG, ScrubConfigError, load_config
from scrubber.jobenv import JobEnvError, job_context
from scrubber.runtime import run

EXIT_CONFIG = 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The prolog/epilog command line (argparse exits on a bad one); given paths override the TOML's."""
    p = argparse.ArgumentParser(prog="python -m scrubber",
                                description="slurm-finetune prolog/epilog: scratch, leftover "
                                            "processes, GPU wipe, scrub report")
    p.add_argument("kind", choices=("prolog", "epilog"))
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help=f"TOML settings (default {DEFAULT_CONFIG}; absent is fine)")
    p.add_argument("--scratch-root", type=str)
    p.add_argument("--report-dir", type=str)
    p.add_argument("--log-dir", type=str)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when every step passed or was skipped; 1 when one failed; 2 for bad settings."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, {"scratch_root": args.scratch_root,
                                        "report_dir": args.report_dir, "log_dir": args.log_dir})
        job = job_context()
        return run(args.kind, cfg, job)
    except (ScrubConfigError, JobEnvError) as e:
        print(f"scrubber {args.kind}: {e}", file=sys.stderr)
        return EXIT_CONFIG
