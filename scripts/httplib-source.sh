#!/usr/bin/env bash
# Extracts Debian's source package of the installed cpp-httplib into DIR, so that the
# ThreadSanitizer build can compile the upstream single header (httplib.h, with Debian's patches)
# into keel with -fsanitize=thread instead of linking Debian's uninstrumented libcpp-httplib.so.
#   scripts/httplib-source.sh DIR
# Idempotent: when DIR already holds the source of the installed version it changes nothing and
# runs no apt-get at all. Otherwise, on Debian 12 as root (or with sudo), it adds a deb-src entry
# for bookworm (/etc/apt/sources.list.d/keel-deb-src.sources) when apt knows no source for the
# package, runs apt-get update and apt-get source (dpkg-dev extracts it and applies the patches).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 DIR" >&2
  exit 2
fi
dest=$1

binary=libcpp-httplib-dev
if ! version=$(dpkg-query -W -f='${source:Version}' "$binary" 2>/dev/null) || [[ -z "$version" ]]; then
  echo "httplib-source: $binary is not installed (run scripts/bootstrap.sh)" >&2
  exit 1
fi
source_pkg=$(dpkg-query -W -f='${source:Package}' "$binary")
stamp="$dest/.keel-debian-source"
if [[ -f "$dest/httplib.h" && -f "$stamp" && "$(cat "$stamp")" == "$source_pkg $version" ]]; then
  echo "httplib-source: $source_pkg $version already in $dest"
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then
    SUDO=sudo
  else
    echo "httplib-source: need root (or sudo) to fetch Debian's $source_pkg source" >&2
    exit 1
  fi
else
  SUDO=
fi
command -v dpkg-source >/dev/null || {
  echo "httplib-source: dpkg-source not found (install dpkg-dev: scripts/bootstrap.sh --test)" >&2
  exit 1
}

# Does apt know the source of exactly the installed version?
has_source() {
  apt-cache showsrc --only-source "$source_pkg" 2>/dev/null | grep -qx "Version: $version"
}
if ! has_source; then
  list=/etc/apt/sources.list.d/keel-deb-src.sources
  if ! grep -rqsE '^(deb-src[[:space:]]|Types:.*deb-src)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "httplib-source: adding Debian bookworm source entries ($list)"
    $SUDO tee "$list" >/dev/null <<'SOURCES'
# Debian source packages, added by keel's scripts/httplib-source.sh (the ThreadSanitizer build
# compiles cpp-httplib from Debian's own source).
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
  fi
  $SUDO apt-get update -qq
  if ! has_source; then
    echo "httplib-source: apt has no source for $source_pkg $version" >&2
    exit 1
  fi
fi

# Download and extract in a scratch folder beside DIR, then move the tree into place.
mkdir -p "$(dirname "$dest")"
work=$(mktemp -d "$(dirname "$dest")/.httplib-source.XXXXXX")
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt downloads as the _apt user when it can write there
echo "httplib-source: fetching Debian's $source_pkg $version"
(cd "$work" && apt-get source -qq "$source_pkg=$version" >/dev/null)
tree=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name "$source_pkg-*" | head -n1)
if [[ -z "$tree" || ! -f "$tree/httplib.h" ]]; then
  echo "httplib-source: no httplib.h in the extracted $source_pkg source" >&2
  exit 1
fi
echo "$source_pkg $version" >"$tree/.keel-debian-source"
rm -rf "$dest"
mv "$tree" "$dest"
echo "httplib-source: $source_pkg $version extracted in $dest"
