# Source on the H200 from the repo root: installs the carried wheels and the project (editable, no deps).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PYTHONPATH
# the core and every plugin distribution of the tree (each folder with a pyproject.toml)
python3 -m pip install -q --no-deps --no-build-isolation -e ./core \
  $(for d in plugins/*/pyproject.toml plugins/*/*/pyproject.toml; do [ -f "$d" ] && printf -- '-e ./%s ' "$(dirname "$d")"; done) \
  > /tmp/pip-project.log 2>&1 || { cat /tmp/pip-project.log; return 1; }
export PATH=$PATH:$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "sources $(bash benchmarks/h200/tree_digest.sh) (benchmarks/h200/tree_digest.sh; the device's .git may be stale)"
