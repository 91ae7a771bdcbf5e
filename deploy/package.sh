#!/usr/bin/env bash
# package.sh — the Debian package: a Release build with the prefix /usr
# (build-deb/), then CPack's DEB generator. Prints the .deb's path last.
#   deploy/package.sh                 the CPU build (no CUDA)
#   TANDEM_CUDA=ON deploy/package.sh  with the CUDA backend (for GPU hosts)
# It installs /usr/bin/tandem*, /etc/tandem/tandem.yaml (a conffile), the
# systemd units in /usr/lib/systemd/system, the docs in /usr/share/doc/tandem
# and, when installed, a `tandem` system user (deploy/deb/postinst). The
# package's Depends come from the libraries the binaries link (dpkg-shlibdeps)
# plus etcd-server. docs/operations.md says how to run it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for t in file dpkg-shlibdeps; do # CPack's DEB generator finds the dependencies' packages with them
  command -v "$t" >/dev/null || { echo "package.sh: $t is missing (apt install file dpkg-dev)" >&2; exit 1; }
done
b=${BUILD_DIR:-build-deb}
case $b in /*) ;; *) b=$root/$b ;; esac
cmake -S . -B "$b" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr -DTANDEM_TESTS=OFF \
  -DTANDEM_CUDA="${TANDEM_CUDA:-OFF}" >/dev/null
cmake --build "$b" -j"$(nproc)" --target tandem tandem-router tandem-prefill tandem-decode tandem-kvstore >/dev/null
(cd "$b" && cpack -G DEB >/dev/null)
ls -1 "$b"/tandem_*.deb | tail -1
