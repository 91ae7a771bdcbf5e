#!/usr/bin/env bash
# test_deb.sh — the Debian package on this machine: installed with apt (its
# dependencies resolved from Debian), checked, run the way its units run it
# (as the `tandem` user; through systemd where systemd is PID 1), one answer
# compared with the installed binary's single-process answer, then removed and
# purged, leaving nothing. Needs root and a machine where tandem is not
# installed. Prints one PASS/FAIL line per check; exit 1 if any failed.
#   tests/package/test_deb.sh [PATH.deb]   (default: deploy/package.sh builds it)
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
[ "$(id -u)" -eq 0 ] || { echo "test_deb: run as root (it installs and purges a package)" >&2; exit 2; }
if dpkg-query -W -f='${Status}' tandem 2>/dev/null | grep -q "install ok"; then
  echo "test_deb: tandem is installed here already; not touching it" >&2; exit 2
fi
deb=${1:-$(deploy/package.sh)}
deb=$(readlink -f "$deb")
fails=0
check() { # NAME, then a command: PASS when it succeeds
  local name=$1; shift
  if "$@" >/dev/null 2>&1; then echo "PASS $name"; else echo "FAIL $name"; fails=$((fails + 1)); fi
}
echo "package: $deb ($(du -h "$deb" | cut -f1))"
dpkg-deb --field "$deb" Package Version Architecture Depends | sed 's/^/  /'
export DEBIAN_FRONTEND=noninteractive
check "apt installs it, its dependencies from Debian" apt-get install -y -q "$deb"
files=$(dpkg -L tandem | while read -r f; do [ -f "$f" ] && echo "$f"; done)
echo "  $(echo "$files" | wc -l) files: $(echo "$files" | grep -c '^/usr/bin/') programs, $(echo "$files" |
  grep -c 'systemd/system/') units, $(echo "$files" | grep -c '^/usr/share/doc/') documents"
check "tandem --version runs from /usr/bin" /usr/bin/tandem --version
check "the programs the units start are there" test -x /usr/bin/tandem-router -a -x /usr/bin/tandem-prefill -a \
  -x /usr/bin/tandem-decode -a -x /usr/bin/tandem-kvstore
uid=$(id -u tandem 2>/dev/null || echo none)
check "a system user tandem (uid $uid, group tandem, no login shell)" \
  sh -c "[ $uid != none ] && [ $uid -lt 1000 ] && id -gn tandem | grep -qx tandem && getent passwd tandem | grep -q nologin"
check "/etc/tandem/tandem.yaml is deploy/tandem.yaml, a conffile" \
  sh -c "cmp -s /etc/tandem/tandem.yaml deploy/tandem.yaml && dpkg-query -W -f='\${Conffiles}' tandem | grep -q /etc/tandem/tandem.yaml"
units=$(ls /usr/lib/systemd/system/tandem-*.service 2>/dev/null | wc -l)
check "$units systemd units in /usr/lib/systemd/system name /usr/bin and /etc/tandem" \
  sh -c "[ $units -eq 5 ] && grep -h ExecStart= /usr/lib/systemd/system/tandem-*.service | grep -v -q /usr/local"
check "the installed units pass systemd-analyze verify" \
  sh -c "cd /usr/lib/systemd/system && systemd-analyze verify tandem-*.service 2>&1 | (! grep .)"

# run it as its units do: the tandem user, its state and cache folders; a copy of the config with the model
work=$(mktemp -d)
chmod 755 "$work"
install -d -o tandem -g tandem "$work/state" "$work/cache"
cp models/SmolLM2-135M-Instruct.Q4_1.gguf "$work/model.gguf" && chmod 644 "$work/model.gguf"
sed "s|^  path: models/SmolLM2-135M-Instruct.Q4_1.gguf|  path: $work/model.gguf|" /etc/tandem/tandem.yaml > "$work/tandem.yaml"
prompt="Write one sentence about the sea."
want=$(/usr/bin/tandem generate --model "$work/model.gguf" --max-tokens 24 --threads 1 --chat "$prompt" 2>/dev/null)
if [ -d /run/systemd/system ]; then
  echo "  systemd is PID 1 here: the cluster through a transient unit of the installed binaries"
  systemd-run --unit tandem-test-up -p User=tandem -p StateDirectory=tandem -p CacheDirectory=tandem \
    -p Environment=XDG_CACHE_HOME=/var/cache --working-directory "$work/state" \
    /usr/bin/tandem up --config "$work/tandem.yaml" >/dev/null
  for _ in $(seq 120); do ep=$(journalctl -u tandem-test-up -o cat | grep -m1 -E '^[0-9.]+:[0-9]+$'); [ -n "$ep" ] && break; sleep 1; done
else
  echo "  systemd is not PID 1 here ($(ps -p 1 -o comm=)): the cluster started as its unit would, as the tandem user"
  (cd "$work/state" && exec runuser -u tandem -- env HOME="$work/state" XDG_CACHE_HOME="$work/cache" \
    /usr/bin/tandem up --config "$work/tandem.yaml" > "$work/ep" 2> "$work/up.log") &
  for _ in $(seq 120); do ep=$(head -1 "$work/ep" 2>/dev/null); [ -n "$ep" ] && break; sleep 1; done
fi
got=$(timeout 60 /usr/bin/tandem generate --endpoint "${ep:-none}" --max-tokens 24 --chat "$prompt" 2>"$work/generate.err")
[ -n "$got" ] || { echo "  tandem generate said:"; tail -5 "$work/generate.err"; tail -20 "$work/up.log" 2>/dev/null; }
echo "  the cluster at ${ep:-nothing}: \"$got\""
check "tandem up as the tandem user served an answer identical to the single process's" \
  sh -c "[ -n \"\$1\" ] && [ \"\$1\" = \"\$2\" ]" _ "$got" "$want"
procs=$(ps -eo user=,args= | grep -v grep | grep -E "tandem-(router|prefill|decode)|etcd" | grep -F "$work/")
echo "  its processes' users: $(echo "$procs" | awk '{print $1}' | sort | uniq -c | xargs)"
check "no process of the cluster runs as root" sh -c "[ -n \"\$1\" ] && ! echo \"\$1\" | grep -q '^root'" _ "$procs"
if [ -d /run/systemd/system ]; then systemctl stop tandem-test-up; else pkill -TERM -u tandem -f "/usr/bin/tandem up"; fi
for _ in $(seq 60); do pgrep -u tandem >/dev/null || break; sleep 1; done
check "the cluster stopped (drained) on SIGTERM" sh -c "! pgrep -u tandem"

check "apt remove takes the programs" apt-get remove -y -q tandem
check "  and keeps the edited config and the user" sh -c "[ ! -e /usr/bin/tandem ] && [ -f /etc/tandem/tandem.yaml ] && id tandem"
check "apt purge takes the rest" apt-get purge -y -q tandem
left=$(echo "$files" | while read -r f; do [ -e "$f" ] && echo "$f"; done)
check "  nothing of the package is left (files, /etc/tandem, the user, the group)" \
  sh -c "[ -z \"\$1\" ] && [ ! -e /etc/tandem ] && ! getent passwd tandem && ! getent group tandem" _ "$left"
rm -rf "$work"
echo "test_deb: $fails failed"
[ "$fails" -eq 0 ]
