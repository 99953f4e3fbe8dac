#!/bin/sh
# Used by cli_test.cmake (MODE launch_killed): `mok launch` killed outright (SIGKILL, no
# handler runs) must leave no child of its ranks running: its guardian stops them. Usage:
#   launch_orphans.sh MOK LOG
# Exits 1 naming (and killing) any rank child still running 4 s after the kill; the launch's
# own output goes to LOG (a child left running would otherwise hold the caller's pipe open).
mok=$1
log=$2
. "$(dirname "$0")/launch_lib.sh"
# (Each rank also starts one process in a session of its own, out of the rank's process group.)
# (The sleeps' lengths carry this script's pid: another test run on the host has its own.)
t=$$
"$mok" launch -n 2 --grace 1 -- sh -c "sleep 81$t & setsid sleep 83$t & sleep 82$t" > "$log" 2>&1 &
launcher=$!
# Killed once both ranks' children run (within 30 s: a slow start must not fail the check).
children_run() { [ "$(matching "sleep 81$t" | wc -l)" -ge 2 ] && [ "$(matching "sleep 83$t" | wc -l)" -ge 2 ]; }
wait_up_to 30 children_run
kill -9 "$launcher"
sleep 4
none_left_running "sleep 81$t" "sleep 82$t" "sleep 83$t"
