#!/bin/sh
# Used by cli_test.cmake (MODE launch_killed): two ranks that fail for their own reasons and
# are seen ended in the same look at the ranks are both named, since the launcher cannot tell
# which came first (it looked at them in index order and named the lower one alone).
# Usage: launch_same_poll.sh MOK LOG
# The launcher is held stopped (SIGSTOP) while ranks 1 and 2 exit, with statuses 2 and 3, and
# continued once both are zombies, so that its next look sees both; rank 0 sleeps until the
# launch stops it. Exits 0 when the launch exits 2 (rank 1's status) naming both ranks, else 1
# with the launch's stderr.
# A STOP that lands inside a look, after rank 1 and before rank 2, lets the rest of that look
# see rank 2 alone (exit 3): a race of the check, not the launcher's fault (one before the fix
# names rank 1 alone), so that outcome is tried again, up to three times in all.
mok=$1
log=$2
. "$(dirname "$0")/launch_lib.sh"
dir="$log.d"
# (The sleep's length carries this script's pid: another test run on the host has its own.)
export MOK_SAME_DIR="$dir" MOK_SAME_SLEEP="87$$"
# (Field 3 of /proc/PID/stat, after the name in parentheses: Z once the rank has exited and
# is not yet reaped; the launcher reaps its ranks only when the launch ends.)
state() { sed -E 's/.*\) (.).*/\1/' "/proc/$1/stat" 2> /dev/null; }
both_started() { [ -s "$dir/pid1" ] && [ -s "$dir/pid2" ]; }
both_exited() { [ "$(state "$(cat "$dir/pid1")")" = Z ] && [ "$(state "$(cat "$dir/pid2")")" = Z ]; }
give_up() {
  echo "$1"
  kill -CONT "$launcher" 2> /dev/null
  kill "$launcher" 2> /dev/null
  wait "$launcher"
  cat "$log"
  none_left_running "sleep $MOK_SAME_SLEEP"
  rm -rf "$dir"
  exit 1
}
for attempt in 1 2 3; do
  rm -rf "$dir"
  mkdir -p "$dir"
  "$mok" launch -n 3 -- sh -c '
    echo $$ > "$MOK_SAME_DIR/pid$MOK_RANK.tmp" && mv "$MOK_SAME_DIR/pid$MOK_RANK.tmp" "$MOK_SAME_DIR/pid$MOK_RANK"
    [ "$MOK_RANK" = 0 ] && exec sleep "$MOK_SAME_SLEEP"
    while [ ! -e "$MOK_SAME_DIR/go" ]; do sleep 0.05; done
    exit $((1 + MOK_RANK))' > "$log" 2>&1 &
  launcher=$!
  wait_up_to 30 both_started || give_up "ranks 1 and 2 never started"
  kill -STOP "$launcher"
  touch "$dir/go"
  wait_up_to 30 both_exited || give_up "ranks 1 and 2 did not exit"
  kill -CONT "$launcher"
  wait "$launcher"
  rc=$?
  [ $rc = 3 ] && grep -q "failed: rank 2 exited with status 3$" "$log" && [ $attempt -lt 3 ] || break
  echo "attempt $attempt: the STOP landed inside a look (rank 2 named alone); again"
done
fine=0
[ $rc = 2 ] || { echo "the launch exited $rc, 2 (rank 1's status) expected"; fine=1; }
grep -q "failed: rank 1 exited with status 2 (rank 2 exited with status 3 too, seen in the same look at the ranks" \
  "$log" || { echo "the launch did not name both ranks that failed"; fine=1; }
[ $fine = 0 ] || cat "$log"
none_left_running "sleep $MOK_SAME_SLEEP" || fine=1
rm -rf "$dir"
exit $fine
