#!/usr/bin/env bash
# The fault-injection suite at its full length: every hostile-input and faulty-machine test, the
# kill matrix with its 48 seeded kill points (12 in the default suite). CI runs the short form
# as part of the README's test command; run this before a release, or after a change to the loop,
# the checkpointer or the data position:
#
#     bash tests/fault_matrix.sh            # extra pytest arguments pass through (-x, -k ...)
#
# The cases, what each gives and the test that proves it: docs/guarantees.md.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -p no:cacheprovider --extended "$@" \
  tests/checkpoint/test_kill_matrix.py \
  tests/checkpoint/test_stop_signals.py \
  tests/checkpoint/test_preemption.py \
  tests/checkpoint/test_output_dir.py \
  tests/checkpoint/test_atomic_writer.py \
  tests/checkpoint/test_resume_data_length.py \
  tests/checkpoint/test_resume_checks.py \
  tests/loop/test_nonfinite_gradients.py \
  tests/loop/test_bad_input.py \
  tests/loop/test_bad_input_messages.py
