#!/usr/bin/env bash
# .ci/beside.sh NAME "BACKGROUND" COMMAND...: run the shell command BACKGROUND beside COMMAND, then show
# BACKGROUND's output (kept in a file while it runs, so the two do not interleave); fail if either failed.
#
# `make test-all` runs the doc test beside the three lanes: a lane keeps about two thirds of the two cores busy,
# and the doc test's commands leave one idle while a rank imports torch. COMMAND failing does not stop
# BACKGROUND (its processes would outlive it): both end, then both statuses count.
set -uo pipefail
name=$1 background=$2
shift 2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
bash -c "$background" > "$log" 2>&1 &
pid=$!
"$@"
status=$?
wait "$pid"
background_status=$?
echo "===== $name (ran beside the lanes; exit status $background_status) ====="
cat "$log"
echo "===== end of $name ====="
if (( status != 0 )); then exit "$status"; fi
exit "$background_status"
