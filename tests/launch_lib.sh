# Sourced by the launch check scripts (launch_orphans.sh, launch_nested.sh).

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
