#!/usr/bin/env bash
# Validates the Kubernetes manifests (deploy/k8s) offline; see scripts/k8s_manifests.py.
#
#   scripts/validate-k8s.sh               render + validate (scripts/test.sh runs this)
#   scripts/validate-k8s.sh --regenerate  rewrite deploy/k8s/base/prometheusrule.yaml from
#                                         deploy/prometheus/alerts.yml, then validate
#
# Python packages come from PyPI into a virtualenv under target/ (created on first use):
# kubernetes-validate (ships the Kubernetes OpenAPI schemas), jsonschema, PyYAML.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV="${CARGO_TARGET_DIR:-target}/k8s-venv"
REQUIREMENTS=(kubernetes-validate==1.37.0 jsonschema==4.26.0 PyYAML==6.0.3)
STAMP="$VENV/.requirements"

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "${REQUIREMENTS[*]}" ]; then
    echo "[validate-k8s] creating $VENV (${REQUIREMENTS[*]})"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "${REQUIREMENTS[@]}"
    echo "${REQUIREMENTS[*]}" >"$STAMP"
fi

if [ "${1:-}" = --regenerate ]; then
    "$VENV/bin/python" scripts/k8s_manifests.py gen-rules
fi
exec "$VENV/bin/python" scripts/k8s_manifests.py validate
