#!/usr/bin/env bash
# Kept for old instructions: the real-GPU check lives in ci/device-check.sh (the entry point).
exec "$(dirname "$0")/../../ci/device-check.sh" "$@"
