# Print a digest of the tree's sources (core/, plugins/, benchmarks/, tests/: .py .cpp .h .sh), the same on this
# machine and on the device: the device's copy of .git may be stale, so its `git rev-parse HEAD` is not what ran.
# Here, `git stash -q; bash benchmarks/h200/tree_digest.sh; git stash pop -q` (or a clean checkout of a commit) gives
# the digest to match a device log against.
find core plugins benchmarks tests -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.sh' \) \
  -not -path '*/.peers/*' -not -path '*/__pycache__/*' -not -path '*.egg-info/*' -print0 \
  | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-12
