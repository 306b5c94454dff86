#!/usr/bin/env bash
# The GPU check on the lent GPU machine, in one call, from the repository root (wheelhouse/ carried beside it):
#     bash benchmarks/gpu_check.sh
# Installs what the project needs besides the machine's own torch and transformers from the offline wheelhouse
# that `python -m benchmarks.gpu_wheelhouse` built (nothing from the network), prints the versions it runs
# on, then runs `python -m benchmarks.gpu` within 8 minutes. Its last line is benchmarks.gpu's JSON object.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -f wheelhouse/requirements.txt ]; then
    echo "gpu_check: no wheelhouse/ here: run python -m benchmarks.gpu_wheelhouse first and carry wheelhouse/" >&2
    exit 2
fi
started=$(date +%s)
python -m pip install -q --no-index --find-links wheelhouse -r wheelhouse/requirements.txt || exit 3
python -m pip install -q --no-index --find-links wheelhouse --no-deps -r wheelhouse/no-deps.txt || exit 3
echo "gpu_check: installed in $(( $(date +%s) - started ))s"
python - <<'EOF'
import platform, torch, transformers
print(f"gpu_check: python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
EOF
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 480 python -m benchmarks.gpu
rc=$?
echo "gpu_check: benchmarks.gpu exit $rc after $(( $(date +%s) - started ))s"
exit $rc
