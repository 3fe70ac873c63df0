#!/usr/bin/env bash
# Installs the storm explorer's npm packages (uPlot for the page, playwright-core for its browser
# test) into web/node_modules, exactly as web/package-lock.json pins them. Idempotent: does
# nothing when they are already installed at the locked versions. `keel sim serve` serves uPlot
# from there (no CDN); ctest runs this script as the fixture of the explorer's tests.
set -euo pipefail
web="$(cd "$(dirname "$0")/../web" && pwd)"
if ! command -v npm >/dev/null; then
  echo "web_setup: npm is missing (scripts/bootstrap.sh --test installs nodejs)" >&2
  exit 1
fi
# npm keeps a copy of the lock file it installed from in node_modules/.package-lock.json.
if [[ -f "$web/node_modules/.package-lock.json" &&
      -f "$web/node_modules/uplot/dist/uPlot.iife.min.js" &&
      -f "$web/node_modules/playwright-core/package.json" ]] &&
   node -e '
     const a = require(process.argv[1]).packages, b = require(process.argv[2]).packages;
     for (const k of Object.keys(a)) if (k && (!b[k] || b[k].version !== a[k].version)) process.exit(1);
   ' "$web/package-lock.json" "$web/node_modules/.package-lock.json"; then
  echo "web_setup: web/node_modules is up to date"
  exit 0
fi
cd "$web"
npm ci --no-audit --no-fund --loglevel=error
echo "web_setup: installed $(node -p 'Object.keys(require("./package-lock.json").packages).filter(Boolean).join(", ")')"
