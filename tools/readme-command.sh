#!/usr/bin/env bash
# Prints one of the README's two commands for a fresh machine, as written:
#   tools/readme-command.sh example   install and run the main example
#   tools/readme-command.sh tests     install and run the tests (.ci/run)
set -euo pipefail
case "${1:-}" in
  example) heading="Install and run the main example" ;;
  tests) heading="Install and run the tests:" ;;
  *) echo "usage: $0 example|tests" >&2; exit 2 ;;
esac
# The first indented line after the heading's line.
command="$(awk -v h="$heading" 'index($0, h) == 1 {f = 1; next}
  f && /^    [^ ]/ {sub(/^    /, ""); print; exit}' \
  "$(dirname "$0")/../README.md")"
[ -n "$command" ] || { echo "$0: README.md has no command after '$heading'" >&2; exit 1; }
printf '%s\n' "$command"
