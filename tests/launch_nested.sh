#!/bin/sh
# Used by cli_test.cmake (MODE launch_killed): a launch inside a rank of another whose inner
# launcher is killed outright leaves its guardian stopping the inner ranks; the outer launch,
# ending meanwhile, must not take that guardian for a process that escaped its rank (it holds
# the outer MOK_LAUNCH_DIR and sits in a group of its own) and kill it before it is done.
# Usage: launch_nested.sh MOK LOG
# The inner rank ignores SIGTERM, so the inner guardian needs its whole --grace (3 s) and then
# SIGKILL; the outer launch's own grace (1 s) is shorter. Exits 1 naming (and killing) the
# inner rank's child if it is still running 8 s after the outer launch ended (the outer
# launch's exit status is not the check).
mok=$1
log=$2
. "$(dirname "$0")/launch_lib.sh"
# (What the rank needs travels in the environment: mok, and the file the inner rank writes
# once its child runs.)
# (The sleep's length carries this script's pid: another test run on the host has its own.)
export MOK_NESTED_MOK="$mok" MOK_NESTED_READY="$log.ready" MOK_NESTED_SLEEP="85$$"
rm -f "$MOK_NESTED_READY"
"$mok" launch -n 1 --grace 1 -- sh -c '
  "$MOK_NESTED_MOK" launch -n 1 --grace 3 -- sh -c "trap \"\" TERM; sleep \$MOK_NESTED_SLEEP & echo up > \"\$MOK_NESTED_READY\"; wait" &
  inner=$!
  n=0
  while [ ! -s "$MOK_NESTED_READY" ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
  kill -9 $inner
  sleep 0.5
  exit 0' > "$log" 2>&1
sleep 8
# (A check that ran nothing fails: the inner rank must have started its child.)
[ -s "$MOK_NESTED_READY" ] || { echo "the inner launch never started its rank's child"; exit 1; }
none_left_running "sleep $MOK_NESTED_SLEEP"
