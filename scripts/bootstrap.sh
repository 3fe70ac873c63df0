#!/usr/bin/env bash
# Installs, on Debian 12, every Debian package keel needs that is not installed yet.
# Idempotent: when everything is present it changes nothing and runs no apt-get at all.
#   scripts/bootstrap.sh            packages to build keel and run the demo
#   scripts/bootstrap.sh --test     also what the test suite needs (PostgreSQL server, wrk, ...)
#   scripts/bootstrap.sh --bench    also the peers `make bench` compares keel with (Go, Python,
#                                   Node.js and their libraries); never needed by `make test`
set -euo pipefail

build_packages=(
  g++ clang cmake ninja-build make pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev libclang-rt-14-dev
  libcurl4-openssl-dev libsqlite3-dev libpq-dev libssl-dev
  libidn2-dev  # keel::http: internationalised host names to their ASCII form (parse_url)
  prometheus-cpp-dev  # keel::metrics and the /metrics of keel jobs work and keel-demo serve
  libcli11-dev nlohmann-json3-dev libcpp-httplib-dev libasio-dev
  libboost-dev  # Boost.Beast and Boost.Asio, header-only: keel::store_beast
  gnuplot-nox curl procps
)
test_packages=(postgresql-15 postgresql-client-15 wrk sqlite3 clang-format clang-tidy
               chromium nodejs  # the storm explorer's browser test (tests/e2e)
               prometheus  # promtool checks deploy/prometheus/keel-alerts.yml
               python3 iproute2  # the doc test (tests/docs) and its private network namespace
               dpkg-dev xz-utils  # apt-get source for make tsan (scripts/httplib-source.sh)
               lintian  # checks the Debian packages (tests/package/run_deb.cmake)
               pgbouncer  # the failover drill's pooler (scripts/pg-cluster.sh --pgbouncer)
               libgrpc++-dev protobuf-compiler protobuf-compiler-grpc)  # keel::grpc and its tests
bench_packages=(golang-go golang-github-cenkalti-backoff-dev python3 python3-tenacity nodejs
                patroni etcd-server)  # scripts/patroni-drill.sh
# Debian's npm conflicts with NodeSource's nodejs, which ships its own npm: only ask for it when
# there is no npm at all.
command -v npm >/dev/null || bench_packages+=(npm)
command -v npm >/dev/null || test_packages+=(npm)

wanted=("${build_packages[@]}")
if [[ "${1:-}" == "--test" ]]; then
  wanted+=("${test_packages[@]}")
elif [[ "${1:-}" == "--bench" ]]; then
  wanted+=("${test_packages[@]}" "${bench_packages[@]}")
elif [[ -n "${1:-}" ]]; then
  echo "bootstrap: unknown option '$1' (expected nothing, --test or --bench)" >&2
  exit 2
fi

missing=()
for pkg in "${wanted[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  echo "bootstrap: all ${#wanted[@]} packages present"
  exit 0
fi

echo "bootstrap: installing ${missing[*]}"
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then
    SUDO=sudo
  else
    echo "bootstrap: missing packages (${missing[*]}) and not root; run as root or install them" >&2
    exit 1
  fi
else
  SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "bootstrap: done"
