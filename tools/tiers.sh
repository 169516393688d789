#!/usr/bin/env bash
# `make test`: runs `make TIER` for each tier given, in order, stopping at
# the first that fails; then prints each tier's wall time and test counts
# and a line of totals. Also when a tier failed, and on SIGTERM (.ci/run's
# bound), after the tier's pytest has stopped and printed its own summary.
#
#   tools/tiers.sh MAKE TIER...
#
# Each pytest session appends "passed failed skipped" to the file named by
# KERASDIST_TEST_TALLY (tests/conftest.py); lint adds no counts.
set -u
make=$1
shift
tally=$(mktemp)
trap 'rm -f "$tally"' EXIT
export KERASDIST_TEST_TALLY=$tally
rows=() passed=0 failed=0 skipped=0 rc=0 tier= start= child=

finish_tier() {
    local p=0 f=0 s=0 status=ok counts=""
    while read -r a b c; do
        p=$((p + a)) f=$((f + b)) s=$((s + c))
    done <"$tally"
    passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
    [ "$rc" = 0 ] || status="FAILED (exit $rc)"
    [ -s "$tally" ] && counts="$p passed, $f failed, $s skipped"
    rows+=("$(printf '%-16s %5d s  %-8s %s' "$tier" \
        $(($(date +%s) - start)) "$status" "$counts")")
}

summary() {
    echo
    echo "== each tier's wall time"
    printf '%s\n' "${rows[@]}"
    echo "tests: $passed passed, $failed failed, $skipped skipped"
}

on_term() {
    rc=143
    [ -n "$child" ] && wait "$child"
    finish_tier
    summary
    exit "$rc"
}
trap on_term TERM

for tier in "$@"; do
    start=$(date +%s)
    : >"$tally"
    # In the background, so that SIGTERM reaches on_term while it runs.
    $make --no-print-directory "$tier" &
    child=$!
    wait "$child" || rc=$?
    child=
    finish_tier
    [ "$rc" = 0 ] || break
done
summary
exit "$rc"
