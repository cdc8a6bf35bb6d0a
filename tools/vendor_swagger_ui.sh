#!/usr/bin/env bash
# Fetch Swagger UI (npm: swagger-ui-dist, Apache-2.0) for /docs, so that the API's page needs no CDN.
# The version and the tarball's integrity are pinned: what is committed under daemon/exod/ui/vendor/ is
# exactly what this fetched. Run it by hand to upgrade (change both pins); CI does not.
set -euo pipefail
VERSION=5.35.0
INTEGRITY=sha512-U06rpMtW9V3XPGOBeamTUSr0Z09jMX4IJuANpE/EZbAhw0G8CgwrzU4YmXkn/h0wCDNsXdGarTNNHC3sU8yVUQ==
DEST="$(cd "$(dirname "$0")/.." && pwd)/daemon/exod/ui/vendor/swagger-ui"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
got="$(npm pack "swagger-ui-dist@$VERSION" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["integrity"])')"
if [ "$got" != "$INTEGRITY" ]; then
  echo "swagger-ui-dist@$VERSION: integrity $got, expected $INTEGRITY" >&2
  exit 1
fi
tar xzf "swagger-ui-dist-$VERSION.tgz"
mkdir -p "$DEST"
for file in swagger-ui-bundle.js swagger-ui-bundle.js.LICENSE.txt swagger-ui.css LICENSE NOTICE; do
  cp "package/$file" "$DEST/$file"
done
echo "swagger-ui-dist $VERSION $INTEGRITY" > "$DEST/VERSION"
echo "wrote $DEST"
