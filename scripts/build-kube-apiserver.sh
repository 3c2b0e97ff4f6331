#!/usr/bin/env bash
# Builds kube-apiserver v1.20.2 for the launcher tests (tests/servers/kube.py), once per machine.
#
# The Go module proxy is not reachable from the test machines, but Debian 12 ships the whole
# upstream v1.20.2 tree, vendor/ included, as the source package `kubernetes` (its binary package
# is only kubectl), so it builds offline. The binary is cached outside the repo; a second run is a
# no-op. The source comes through a private deb-src list, so the machine's apt sources stay as
# they are. ../shared/TEST-INFRA.md has the measurements (5-16 min, 1.3 GB RSS, 1.8 GB of tree).
set -euo pipefail

VERSION=v1.20.2
CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/spotrl"
BINARY="$CACHE_DIR/kube-apiserver-$VERSION"

if [ -x "$BINARY" ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi

missing=()
command -v go >/dev/null || missing+=(golang-go)
command -v etcd >/dev/null || missing+=(etcd-server)
command -v rsync >/dev/null || missing+=(rsync)
command -v make >/dev/null || missing+=(make)
command -v openssl >/dev/null || missing+=(openssl)
command -v dpkg-source >/dev/null || missing+=(dpkg-dev)
if [ ${#missing[@]} -gt 0 ]; then
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

mkdir -p "$CACHE_DIR"
WORK="$(mktemp -d "$CACHE_DIR/kube-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# A private apt configuration: deb-src entries and lists of its own, the system's left untouched.
APT="$WORK/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial"
cat > "$APT/sources.list" <<SRC
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
SRC
apt_private=(-o Dir::Etc::SourceList="$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o Dir::State::Lists="$APT/lists" -o Dir::Cache="$APT/cache"
             -o APT::Sandbox::User=root)
apt-get "${apt_private[@]}" update -q
cd "$WORK"
apt-get "${apt_private[@]}" source --download-only kubernetes
# Go >= 1.18 crashes the vendored reflect2 1.0.1 (`fatal error: fault` in mapiterinit on the first
# custom-resource create): its 1.0.2 source from Debian replaces it.
apt-get "${apt_private[@]}" download golang-github-modern-go-reflect2-dev

mkdir src
tar -xf kubernetes_*.orig.tar.* -C src --strip-components=1
dpkg-deb -x golang-github-modern-go-reflect2-dev_*.deb reflect2
REFLECT2_VENDOR=src/vendor/github.com/modern-go/reflect2
rm -f "$REFLECT2_VENDOR"/*.go "$REFLECT2_VENDOR"/*.s
cp reflect2/usr/share/gocode/src/github.com/modern-go/reflect2/*.go "$REFLECT2_VENDOR"/
find reflect2/usr/share/gocode/src/github.com/modern-go/reflect2 -maxdepth 1 -name '*.s' \
    -exec cp {} "$REFLECT2_VENDOR"/ \;
rm -f "$REFLECT2_VENDOR"/*_test.go

cd src
GOPROXY=off GOFLAGS=-mod=vendor CGO_ENABLED=0 GOCACHE="$WORK/gocache" \
    make WHAT=cmd/kube-apiserver
install -m 0755 _output/bin/kube-apiserver "$BINARY.tmp"
mv "$BINARY.tmp" "$BINARY"
echo "built $BINARY"
