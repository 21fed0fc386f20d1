"""``finetune(1)``: the manual page, generated from the click commands themselves (so it never
drifts from ``--help``), and the shell completion scripts.

``finetune man [--output FILE]`` writes the page (troff, ``man -l FILE`` reads it); the set-up
(``scripts/bootstrap.sh``) installs it as ``/usr/local/share/man/man1/finetune.1`` (``man finetune``).
``finetune completion bash|zsh`` prints click's completion script for that shell.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version

import click
from click.shell_completion import get_completion_class

SHELLS = ("bash", "zsh")
COMPLETE_VAR = "_FINETUNE_COMPLETE"
ENVIRONMENT = (
    ("SFT_API_URL", "The gateway's URL for the tenant commands (else the one `finetune login` saved)."),
    ("SFT_API_TOKEN", "An API token for the tenant commands (else the one `finetune login` saved)."),
    ("SFT_CREDENTIALS_FILE", "Where `finetune login` saves the URL and token "
                             "(default ~/.config/slurm-finetune/credentials.json, mode 0600)."),
    ("SFT_DATABASE_URL", "The gateway's database, for `finetune admin` and the services."),
    ("SFT_BACKEND", "`local` runs the gateway without Slurm (local mode)."),
    ("SFT_DEBUG", "`1` shows the stack trace of a failure instead of its one-line message."),
)


def _esc(text: str) -> str:
    """Text safe in a troff body line: backslashes doubled, a leading dot or quote escaped."""
    text = text.replace("\\", "\\\\").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def _leaves(cmd: click.Command, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.commands):
            sub = cmd.commands[name]
            if not sub.hidden:
                yield from _leaves(sub, (*path, name))
    else:
        yield path, cmd


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def render(main: click.Group) -> str:
    """The troff source of finetune(1) for the command tree ``main``."""
    try:
        release = version("slurm-finetune")
    except PackageNotFoundError:
        release = "unknown"
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    out = [f'.TH FINETUNE 1 "{day}" "slurm-finetune {release}" "User Commands"',
           ".SH NAME", "finetune \\- private QLoRA fine\\-tuning on a shared SLURM cluster",
           ".SH SYNOPSIS", ".B finetune", "\\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIARGS\\fR]...",
           ".SH DESCRIPTION"]
    out += [_esc(p) for p in _paragraphs(main.help or "")]
    out += [".PP", _esc("Tenants upload datasets, create, follow and cancel jobs and download their models over "
                        "the gateway's HTTP API; sysadmins run `finetune admin` on the gateway's host. Every "
                        "command takes --help; every failure is one line on stderr and exit status 1 "
                        "(with --json: OpenAI's error object)."),
            ".SH COMMANDS"]
    for path, cmd in _leaves(main, ()):
        ctx = click.Context(cmd, info_name=" ".join(("finetune", *path)))
        out += [".TP", f".B {_esc(' '.join(('finetune', *path)))}",
                _esc(" ".join(cmd.collect_usage_pieces(ctx)))]
        for p in _paragraphs(cmd.help or ""):
            out += [".IP", _esc(p)]
        for param in cmd.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is None or record[0] == "--help":
                continue
            opts, help_text = record
            out += [".RS", ".TP", f".B {_esc(opts)}", _esc(" ".join(help_text.split()) or "(a flag)"), ".RE"]
    out += [".SH ENVIRONMENT"]
    for name, text in ENVIRONMENT:
        out += [".TP", f".B {name}", _esc(text)]
    out += [".SH SHELL COMPLETION", _esc("bash: add `eval \"$(finetune completion bash)\"` to ~/.bashrc. "
                                         "zsh: add `eval \"$(finetune completion zsh)\"` to ~/.zshrc. "
                                         "Commands, options and choices complete."),
            ".SH FILES", ".TP", ".B ~/.config/slurm\\-finetune/credentials.json",
            _esc("The gateway URL and token `finetune login` saved (0600)."),
            ".TP", ".B /srv/slurm\\-finetune/tenants/<tenant>/",
            _esc("A tenant's datasets, jobs and results, owned by its unix user (0700)."),
            ".SH SEE ALSO", "sbatch(1), sacct(1), sshare(1)", ""]
    return "\n".join(out)


def completion_source(main: click.Group, shell: str) -> str:
    """Click's completion script for ``shell`` (bash or zsh), for the ``finetune`` program."""
    cls = get_completion_class(shell)
    if cls is None or shell not in SHELLS:
        raise click.BadParameter(f"no completion for {shell!r}; choose one of: {', '.join(SHELLS)}")
    return cls(main, {}, "finetune", COMPLETE_VAR).source()


def _root(ctx: click.Context) -> click.Group:
    """The ``finetune`` group this command runs under."""
    root = ctx.find_root().command
    assert isinstance(root, click.Group)
    return root


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script: `eval "$(finetune completion bash)"` in ~/.bashrc
    (or zsh in ~/.zshrc) completes commands, options and choices."""
    click.echo(completion_source(_root(ctx), shell))


@click.command("man")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Write the page here (the set-up: /usr/local/share/man/man1/finetune.1) instead of stdout.")
@click.pass_context
def man(ctx: click.Context, output: str | None) -> None:
    """Print finetune(1), the manual page of every command, generated from this very command tree."""
    page = render(_root(ctx))
    if output is None:
        click.echo(page, nl=False)
        return
    with open(output, "w", encoding="utf-8") as f:
        f.write(page)
