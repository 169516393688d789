#!/usr/bin/env bash
# The Debian packages the tests need beyond pip's (tools/system-packages.txt):
# installs the missing ones with apt-get when run as root, saying which;
# otherwise (or with --check) says which are missing and how to install
# them, and exits 0: the tests that need a missing one skip, naming it.
#
#   tools/system-packages.sh           install what is missing (as root)
#   tools/system-packages.sh --check   only say what is missing
set -euo pipefail
list="$(dirname "$0")/system-packages.txt"
check_only=0
case "${1:-}" in
  --check) check_only=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

libs=""
present() {
  case "$1" in
    command:*) command -v "${1#command:}" >/dev/null || [ -x "/usr/sbin/${1#command:}" ] ;;
    lib:*) grep -qxF "${1#lib:}" <<<"$libs" ;;
    *) echo "$list: unknown probe '$1'" >&2; exit 2 ;;
  esac
}
missing() {
  local package probe _
  # What the dynamic linker knows now (again after an install).
  libs="$( (ldconfig -p 2>/dev/null || /sbin/ldconfig -p) | awk 'NR > 1 {print $1}')"
  while read -r package probe _; do
    case "$package" in ''|'#'*) continue ;; esac
    present "$probe" || printf '%s ' "$package"
  done <"$list"
}

want="$(missing)"; want="${want% }"
if [ -z "$want" ]; then
  echo "system packages: all the tests need are here (tools/system-packages.txt)"
  exit 0
fi
if [ "$check_only" = 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "system packages: installing what the tests need with apt-get: $want (tools/system-packages.txt says what each is for)"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  apt-get update -qq && apt-get install -y -qq $want >/dev/null
  still="$(missing)"; still="${still% }"
  if [ -n "$still" ]; then
    echo "system packages: still missing after apt-get install: $still" >&2
    exit 1
  fi
  echo "system packages: installed"
  exit 0
fi
echo "system packages: missing $want; the tests that need them will skip, naming the package."
echo "  To run those tests too: sudo $0  (or: sudo apt-get install $want)"
