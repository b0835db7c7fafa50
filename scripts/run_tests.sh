#!/usr/bin/env bash
# `make test`: every test suite (the core's and each plugin's), in two lanes that run at
# the same time. Run one after another, the suites leave a 2-core machine about 40 % idle
# (they mostly wait for processes, Ray actors and clusters to start), so two lanes take
# about two thirds of the time. Every suite runs, even after one failed; the exit status
# is 1 when any failed.
#
#   [SLOW=1] scripts/run_tests.sh PYTHON "PLUGIN_DIRS" "LANE1_PLUGINS" [PYTEST_ARGS...]
#
# Without SLOW=1 (`make test`), the tests marked `slow` (long scenarios: multi-node
# clusters, restarts, the full examples) are left out of every suite: lane 1 runs the
# core's tests, lane 2 every plugin's.
# With SLOW=1 (`make test SLOW=1`, what .ci/run runs), every test runs: lane 1 the core's
# slow tests, then the plugins named in LANE1_PLUGINS; lane 2 the core's other tests,
# then every other plugin (a new plugin goes here).
# Each suite's output goes to a log, printed whole when its lane ends, with a line per
# suite as it starts and ends.
set -uo pipefail
py=$1
plugins=$2
lane1_names=" $3 "
shift 3
logs=$(mktemp -d "${TMPDIR:-/tmp}/dlrover-test-logs.XXXXXX")
failed="$logs/failed"
: >"$failed"

run_suite() {  # run_suite NAME LOG pytest-args...: one suite, its result line on stdout
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: started"
  "$py" -m pytest -q "$@" >"$log" 2>&1
  local rc=$?
  # rc 5: no test collected (a filter that leaves nothing is not a failure)
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    echo "$name" >>"$failed"
  fi
  echo "== $name: exit $rc after $((SECONDS - t0)) s: $(tail -n 1 "$log")"
}

lane() {  # lane N: its suites one after another, then their logs
  local n=$1 p name
  local -a only=()
  if [ "${SLOW:-}" = 1 ]; then
    if [ "$n" = 1 ]; then
      run_suite "core (slow)" "$logs/1-core.log" tests -m slow "${@:2}"
    else
      run_suite "core" "$logs/2-core.log" tests -m "not slow" "${@:2}"
    fi
  else
    only=(-m "not slow")
    [ "$n" = 1 ] && run_suite "core" "$logs/1-core.log" tests "${only[@]}" "${@:2}"
  fi
  for p in $plugins; do
    name=$(basename "$p")
    if [ "${SLOW:-}" = 1 ]; then
      case "$lane1_names" in
        *" $name "*) [ "$n" = 1 ] || continue ;;
        *) [ "$n" = 2 ] || continue ;;
      esac
    else
      [ "$n" = 2 ] || continue
    fi
    run_suite "$p" "$logs/$n-$name.log" "${p}tests" --rootdir "$p" -c "${p}pyproject.toml" \
      "${only[@]}" "${@:2}"
  done
}

lane 1 "$@" &
lane1_pid=$!
lane 2 "$@"
wait "$lane1_pid"
elapsed=$SECONDS
for log in "$logs"/*.log; do
  echo "================ $(basename "$log" .log)"
  cat "$log"
done
echo "both lanes ended after $elapsed s"
if [ -s "$failed" ]; then
  echo "FAILED suites:" $(cat "$failed")
  rm -rf "$logs"
  exit 1
fi
echo "every suite passed"
if [ "${SLOW:-}" != 1 ] && [ "$elapsed" -gt 720 ]; then
  # make test's budget: 15 minutes on a 2-core machine, its setup (about 3) included
  echo "make test took over 12 minutes: mark the tests of 25 s or more \`slow\`" \
    "(PYTEST_ARGS=--durations=20 names them)"
fi
rm -rf "$logs"
