#!/usr/bin/env bash
# Runs the whole test suite against the project as installed from the working
# tree.  Extra arguments go to pytest.  pytest's exit code 5 ("no tests
# collected", e.g. after a -k filter that matches nothing) is reported and
# treated as a failure, since a run that tested nothing proves nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit code 5): nothing was tested" >&2
fi
exit "$rc"
