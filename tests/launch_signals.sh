#!/bin/sh
# Used by cli_test.cmake (MODE launch_signals): how `mok launch` treats signals. Usage:
#   launch_signals.sh MOK WORK
# Prints what failed and exits 1, or exits 0. Every launch is bounded (60 s), so a launcher
# that hangs fails the check instead of hanging it.
mok=$1
work=$2
. "$(dirname "$0")/launch_lib.sh"
mkdir -p "$work"
failed=0
fail() {
  echo "FAIL: $*"
  failed=1
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }
# Waits for the background launcher $1, killed after 60 s (a hang fails, never blocks), and
# sets rc to its status. (Signals go to the launcher itself, not through timeout(1); no
# watchdog process is left behind to hold the caller's pipes.)
ended() { [ ! -e "/proc/$1/stat" ] || [ "$(cut -d' ' -f3 "/proc/$1/stat" 2> /dev/null)" = Z ]; }
bounded_wait() {
  wait_up_to 60 ended "$1"
  kill -9 "$1" 2> /dev/null
  wait "$1"
  rc=$?
}
# Signals the background launcher $1 twice (SIGTERM after 1 s, again 0.5 s later, while it is
# stopping the ranks), then bounded_wait; sets ms to the time since t0.
term_twice() {
  sleep 1
  kill -TERM "$1"
  sleep 0.5
  kill -TERM "$1" 2> /dev/null
  bounded_wait "$1"
  ms=$(($(now_ms) - t0))
}

# 1. Started with SIGCHLD ignored (the kernel would reap the ranks unseen): it still sees
#    them end, and exits 0 at once instead of waiting for ever.
t0=$(now_ms)
# (python3, since a shell may reset SIGCHLD for the commands it runs.)
timeout 60 python3 -c 'import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])' \
  "$mok" launch -n 2 -- true > "$work/chld.log" 2>&1
rc=$?
[ $rc -eq 0 ] && [ $(($(now_ms) - t0)) -lt 20000 ] || fail "launched with SIGCHLD ignored: rc $rc: $(cat "$work/chld.log")"

# 2. SIGHUP ignored when it started (nohup): a SIGHUP stops nothing, in the launcher or
#    the ranks (each sends itself one, then says it is still there).
rm -f "$work"/hup_*
sh -c 'trap "" HUP; exec "$0" launch -n 2 -- sh -c "kill -HUP \$\$; sleep 2; touch \"$1/hup_\$MOK_RANK\""' \
  "$mok" "$work" > "$work/hup.log" 2>&1 &
launcher=$!
sleep 1
kill -HUP $launcher 2> /dev/null
bounded_wait $launcher
[ $rc -eq 0 ] && [ -e "$work/hup_0" ] && [ -e "$work/hup_1" ] ||
  fail "SIGHUP ignored from the start: rc $rc, ranks left: $(ls "$work" | grep -c hup_): $(cat "$work/hup.log")"

# 3. A second signal while the ranks are being stopped (they ignore SIGTERM; the grace is
#    30 s) kills them at once.
t0=$(now_ms)
"$mok" launch -n 2 --grace 30 -- sh -c 'trap "" TERM; sleep 7791'"$$" > "$work/again.log" 2>&1 &
term_twice $!
[ $rc -eq 143 ] && [ $ms -lt 15000 ] && grep -q "killing them now" "$work/again.log" ||
  fail "a second SIGTERM while stopping: rc $rc after $ms ms (143 at once expected): $(cat "$work/again.log")"

# 4. A signal while the processes that ranks left behind are being stopped (the ranks exited
#    0; their child ignores SIGTERM): killed at once, and the launch fails with 128+N.
t0=$(now_ms)
"$mok" launch -n 1 --grace 30 -- sh -c '(trap "" TERM; sleep 7792'"$$"') & exit 0' > "$work/left.log" 2>&1 &
launcher=$!
sleep 1
kill -TERM $launcher
bounded_wait $launcher
ms=$(($(now_ms) - t0))
[ $rc -eq 143 ] && [ $ms -lt 15000 ] ||
  fail "a SIGTERM while stopping a rank's leftovers: rc $rc after $ms ms (143 at once expected): $(cat "$work/left.log")"

# 5. A SIGTERM right after the ranks are forked reaches each of them as SIGTERM (none is left
#    to the SIGKILL after the grace, 20 s here) however early it comes.
for delay in 0.01 0.03 0.05; do
  t0=$(now_ms)
  "$mok" launch -n 100 --grace 20 -- sleep "7793$$" > "$work/early.log" 2>&1 &
  launcher=$!
  sleep $delay
  kill -TERM $launcher
  bounded_wait $launcher
  ms=$(($(now_ms) - t0))
  [ $rc -eq 143 ] && [ $ms -lt 15000 ] ||
    fail "a SIGTERM $delay s into a launch of 100: rc $rc after $ms ms (143 within the grace expected)"
done

# 6. A second signal kills at once what the ranks left behind too, not only the ranks (rank 0
#    exits 0 leaving a child that ignores SIGTERM; rank 1 ignores it; the grace is 30 s).
t0=$(now_ms)
"$mok" launch -n 2 --grace 30 -- sh -c \
  'if [ "$MOK_RANK" = 0 ]; then (trap "" TERM; sleep 7794'"$$"') & exit 0; fi; trap "" TERM; sleep 7795'"$$" \
  > "$work/both.log" 2>&1 &
term_twice $!
[ $rc -eq 143 ] && [ $ms -lt 15000 ] ||
  fail "a second SIGTERM with a rank's leftovers to stop: rc $rc after $ms ms (143 at once expected): $(cat "$work/both.log")"

# 7. A signal that comes as the last rank ends: the launch fails with 128+N, saying so (not
#    that it stopped leftovers there were none of).
"$mok" launch -n 1 -- sh -c 'kill -TERM $PPID; exit 0' > "$work/last.log" 2>&1 &
bounded_wait $!
[ $rc -eq 143 ] && grep -q "got signal Terminated" "$work/last.log" && ! grep -q "processes the ranks left" "$work/last.log" ||
  fail "a SIGTERM as the last rank ended: rc $rc: $(cat "$work/last.log")"

# Nothing of these launches may be left running. (Their sleeps' lengths end in this script's
# pid, so that a run beside this one, another checkout's CI say, is neither blamed nor killed.)
none_left_running "sleep 7791$$" "sleep 7792$$" "sleep 7793$$" "sleep 7794$$" "sleep 7795$$" ||
  fail "processes of these launches were left running"
exit $failed
