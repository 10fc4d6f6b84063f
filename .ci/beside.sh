#!/usr/bin/env bash
# .ci/beside.sh NAME "BACKGROUND" COMMAND...: run the shell command BACKGROUND beside COMMAND, then show
# BACKGROUND's output (kept in a file while it runs, so the two do not interleave); fail if either failed.
#
# `make test-all` runs the doc test beside the three lanes: a lane keeps about two thirds of the two cores busy,
# and the doc test's commands leave one idle while a rank imports torch. COMMAND failing does not stop
# BACKGROUND (its processes would outlive it): both end, then both statuses count. Interrupted (Ctrl-C, or a
# TERM from CI's own time limit), it passes SIGINT on to both, waits for them and shows what BACKGROUND printed.
set -uo pipefail
name=$1 background=$2
shift 2
log=$(mktemp)
show() {
  echo "===== $name (ran beside the lanes; exit status $1) ====="
  cat "$log"
  echo "===== end of $name ====="
  rm -f "$log"
}
set -m  # each in a process group of its own, where SIGINT is not ignored as for a plain `&`
bash -c "$background" > "$log" 2>&1 &
background_pid=$!
"$@" &
command_pid=$!
set +m
stop() {
  trap - INT TERM
  kill -INT -- "-$command_pid" "-$background_pid" 2> /dev/null
  wait "$command_pid"
  wait "$background_pid"
  show "$? (interrupted)"
  exit 130
}
trap stop INT TERM
wait "$command_pid"
status=$?
wait "$background_pid"
background_status=$?
trap - INT TERM
show "$background_status"
if (( status != 0 )); then exit "$status"; fi
exit "$background_status"
