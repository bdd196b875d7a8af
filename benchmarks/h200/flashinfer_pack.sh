#!/usr/bin/env bash
# Build .fi/ (git-ignored, carried to the H200 with `carry: [".fi"]`): a trimmed FlashInfer for the
# kernels the flashinfer attention plugin JIT-compiles (FA2 and FA3/sm90 batch prefill, batch decode,
# the custom-mask bit packing), plus the apache-tvm-ffi wheel it imports. Run here (not on the device):
#   bash benchmarks/h200/flashinfer_pack.sh [/tmp/fi/flashinfer_python-0.7.4-py3-none-any.whl] [/tmp/fi]
# What goes in (read straight from the wheel, nothing unpacked into the repo):
#   - every flashinfer/*.py outside data/ (the import graph of flashinfer.prefill/decode is wide but
#     all Python); flashinfer/__init__.py is replaced by a minimal one, so `import flashinfer.prefill`
#     does not import the whole package (whose top level pulls cutlass-dsl, cuda-tile, nccl4py...);
#   - data/include (FlashInfer's headers), data/cutlass/include + tools/util/include (cute, for FA3),
#     data/cccl and data/spdlog (the JIT's include path puts them ahead of the toolkit's copies);
#   - the data/csrc files the prefill/decode/quantization generators read, and every csrc header they
#     include (scanned transitively);
# and leaves out the rest of data/csrc (~390 MB of MoE, GEMM, comm... sources) and the cubins.
set -euo pipefail
WHEEL=${1:-/tmp/fi/flashinfer_python-0.7.4-py3-none-any.whl}
DEPS=${2:-$(dirname "$WHEEL")}
cd "$(dirname "$0")/../.."
mkdir -p .fi
TVM=$(ls "$DEPS"/apache_tvm_ffi-*cp312*manylinux*x86_64*.whl 2>/dev/null | head -1 || true)
if [ -z "$TVM" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    -d "$DEPS" 'apache-tvm-ffi<0.2,>=0.1.11'
  TVM=$(ls "$DEPS"/apache_tvm_ffi-*cp312*manylinux*x86_64*.whl | head -1)
fi
rm -f .fi/apache_tvm_ffi-*.whl
cp "$TVM" .fi/
python3 - "$WHEEL" .fi/flashinfer-trim.tar.xz <<'PY'
import io, re, sys, tarfile, time, zipfile

wheel, dest = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(wheel)
names = set(z.namelist())
D = "flashinfer/data/"
MINIMAL_INIT = b'''"""Trimmed FlashInfer (radixserve benchmarks/h200/flashinfer_pack.sh): the package's top level imports
nothing, so `import flashinfer.prefill` / `flashinfer.decode` load only what they need."""
from .version import __version__ as __version__
'''
CSRC_ROOTS = re.compile(r"^(batch_prefill|batch_decode(?!_mla)|quantization\.cu|csf_scales\.cu|"
                        r"flashinfer_quantization_binding|page\.cu|flashinfer_page_binding|tvm_ffi_utils)")
INCLUDE_DIRS = [D + "csrc/", D + "include/"]  # searched for csrc's includes (closure); the rest go in whole
WHOLE_DIRS = [D + "include/", D + "cutlass/include/", D + "cutlass/tools/util/include/", D + "cccl/", D + "spdlog/include/"]
INC = re.compile(rb'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)

pick = set()
for n in names:
    if n.startswith("flashinfer/") and not n.startswith(D) and n.endswith(".py"):
        pick.add(n)
    elif any(n.startswith(w) for w in WHOLE_DIRS) and not n.endswith("/"):
        pick.add(n)
    elif n.startswith(D + "csrc/") and "/" not in n[len(D + "csrc/"):] and CSRC_ROOTS.match(n[len(D + "csrc/"):]):
        pick.add(n)
# transitive includes of the picked csrc files, resolved against the file's folder and csrc/include
todo = [n for n in pick if n.startswith(D + "csrc/")]
seen = set(todo)
while todo:
    n = todo.pop()
    folder = n.rsplit("/", 1)[0] + "/"
    for inc in INC.findall(z.read(n)):
        inc = inc.decode()
        for base in [folder] + INCLUDE_DIRS:
            cand = base + inc
            if cand in names and cand not in seen:
                seen.add(cand); pick.add(cand); todo.append(cand)
                break
pick.discard("flashinfer/__init__.py")
t0 = time.time()
raw = 0
with tarfile.open(dest, "w:xz", preset=6) as tar:
    def add(name, data):
        info = tarfile.TarInfo(name); info.size = len(data); info.mode = 0o644; info.mtime = 0
        tar.addfile(info, io.BytesIO(data))
    add("flashinfer/__init__.py", MINIMAL_INIT)
    for n in sorted(pick):
        data = z.read(n); raw += len(data); add(n, data)
    meta = [n for n in names if n.startswith("flashinfer_python-") and n.endswith((".dist-info/METADATA",))]
    for n in meta:
        add(n, z.read(n))
import os
csrc = sorted(n for n in pick if n.startswith(D + "csrc/"))
print(f"packed {len(pick)} files, {raw / 2**20:.1f} MB raw -> {os.path.getsize(dest) / 2**20:.1f} MB xz "
      f"in {time.time() - t0:.0f}s; csrc files: {len(csrc)}")
PY
ls -la .fi/
du -sh .fi
