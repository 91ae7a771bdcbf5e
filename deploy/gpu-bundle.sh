#!/usr/bin/env bash
# gpu-bundle.sh — builds tandem with CUDA for Hopper and gathers, in bundle/
# (git-ignored), what a GPU-machine run needs: the CUDA check, its fixtures and
# the tiny Hugging Face model with the script that computes its reference
# logits there. Carry bundle/ to the GPU machine and run bundle/run.sh there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cmake -S . -B build-gpu -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DTANDEM_TESTS=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-gpu -j"$(nproc)" --target tandem-cuda-check >/dev/null
rm -rf bundle && mkdir -p bundle/fixtures
cp build-gpu/bin/tandem-cuda-check bundle/
cp tests/fixtures/dequant/crafted.gguf bundle/fixtures/
cp -r tests/fixtures/hf/tiny-llama3 bundle/fixtures/
cp tests/fixtures/hf/make_logits_hf.py bundle/fixtures/
cat > bundle/run.sh <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: the CUDA backend check, then the HF reference logits.
set -u
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$here/tandem-cuda-check" "$here/fixtures/crafted.gguf"; rc=$?
python3 "$here/fixtures/make_logits_hf.py" "${OUT:-/tmp}/tiny-llama3-logits.json" || rc=1
exit $rc
RUN
chmod +x bundle/run.sh
du -sh bundle
