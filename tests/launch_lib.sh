# Sourced by the launch check scripts (launch_orphans.sh, launch_nested.sh, launch_same_poll.sh,
# launch_signals.sh).

# Runs the command "$2..." every 0.1 s until it succeeds (returns 0) or $1 seconds have passed
# (returns 1): a slow start on a loaded host must not fail a check, nor a hang block it.
wait_up_to() {
  wait_tenths=$(($1 * 10))
  shift
  until "$@"; do
    [ $wait_tenths -gt 0 ] || return 1
    sleep 0.1
    wait_tenths=$((wait_tenths - 1))
  done
}

# The processes whose whole command line is exactly "$1 " (cmdline, NULs as blanks).
matching() {
  for f in /proc/[0-9]*/cmdline; do
    [ "$(tr '\000' ' ' < "$f" 2> /dev/null)" = "$1 " ] && basename "$(dirname "$f")"
  done
}

# Names and kills every process whose command line is exactly one of the arguments; returns 1
# if there was any (a process the launch should have stopped), else 0.
none_left_running() {
  left=0
  for command in "$@"; do
    for pid in $(matching "$command"); do
      echo "left running: $pid ($command)"
      kill -9 "$pid" 2> /dev/null
      left=1
    done
  done
  return $left
}
