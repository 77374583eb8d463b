#!/usr/bin/env bash
# Runs the whole test suite against the project as installed from the working
# tree, on two workers (SPYRE_TEST_WORKERS).  Extra arguments go to pytest.
# pytest's exit code 5 ("no tests collected", e.g. after a -k filter that
# matches nothing) is reported and treated as a failure, since a run that
# tested nothing proves nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
# Two workers (pytest-xdist), each taking a whole test file at a time, so
# that a file's engines and module fixtures stay in one process.  Files are
# handed out in collection order, which tests/conftest.py sets longest
# first (xdist's own order, by number of tests, would leave the long files
# with few tests for last).  Arguments given after these win (`-n 0` runs
# in this process).
# Each worker's engines use every core, so two workers' OpenMP threads
# share the cores: waiting threads must sleep, not spin (with GNU OpenMP's
# default spinning, two files side by side took longer than one after the
# other; docs/testing.md, "Time").
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
.venv/bin/python -m pytest -n "${SPYRE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit code 5): nothing was tested" >&2
fi
exit "$rc"
