#!/usr/bin/env bash
# Write .old/ (git-ignored; carry it with `carry: [".old"]`): the core and the radix-cache plugin of an earlier
# commit, for an A/B on the device in one call: scripts run the old side with
# `PYTHONPATH=.old/core:.old/plugins/cache/radix:$PYTHONPATH` (those directories come first on sys.path, ahead
# of the editable installs of the current tree; the other plugins are the current ones).
#   bash benchmarks/h200/old_tree.sh 13a9612
set -euo pipefail
REV=${1:?usage: old_tree.sh COMMIT}
cd "$(dirname "$0")/../.."
rm -rf .old && mkdir -p .old
git archive "$REV" core plugins/cache/radix | tar -x -C .old
echo "$REV" > .old/REV
du -sh .old
