#!/usr/bin/env bash
# Everything that needs a GPU, for a short lease: each part is one command of BENCHMARKS.md
# section 8, results in benchmarks/results/ as usual.
#
#   bash benchmarks/cuda_suite.sh                   # all but setting_b, ~17 min on one H100 (overlap ~5 min, a guess)
#   bash benchmarks/cuda_suite.sh tests kernels     # some of: tests train overlap allcpu kernels throughput storage setting_b kinds finetune
#
# Times seen on the H100 (round 10): tests 21 s, throughput 7 min, allcpu 1.5 min, storage 20 s.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'cuda_suite.sh: no CUDA device here')"
GPT=(--layers 8 --width 2048 --seq 512)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests train overlap allcpu kernels throughput storage)
run_part() {
  case "$1" in
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py ;;
    train) python3 -m snake.cli train --steps 30 --out benchmarks/.scratch/train-gpu ;;  # the README's main job on the GPU
    overlap) python3 benchmarks/stage_overlap.py --device cuda "${GPT[@]}" --ms 4,16 --rounds 1 --steps 3 \
               --name stage_overlap_gpu ;;  # round 11's run-ahead against waiting for each job
    kernels) python3 benchmarks/kernels.py --device cuda "${GPT[@]}" --m 16 --rounds 3 --ab-rounds 0 --name kernels_gpu ;;
    throughput) python3 benchmarks/throughput.py --device cuda "${GPT[@]}" --budget-mib 6300 --cap-mb 1000 \
                  --capped-only --roof-rounds 1 --steps 3 --ms 1,2,4,8,16,32 --name throughput_gpu ;;
    setting_b) python3 benchmarks/throughput.py --device cuda "${GPT[@]}" --budget-mib 7000 --cap-mb 1000 \
                 --capped-only --roof-rounds 1 --steps 3 --ms 1,2,4,8,16,32 --name throughput_gpu_b ;;
    allcpu) python3 benchmarks/throughput.py --device cuda "${GPT[@]}" --budget-mib 12000 --cap-mb 1000 \
              --capped-only --roof-rounds 1 --steps 3 --ms 4,16 --name throughput_gpu_allcpu ;;
    kinds) python3 benchmarks/kinds.py --device cuda --layers 8 --width 1024 --seq 512 --m 8 --rounds 2 --steps 3 \
             --name kinds_gpu ;;  # round 24's layers of two kinds against in-memory PyTorch
    finetune) python3 benchmarks/frozen_bottom.py --device cuda --layers 8 --width 2048 --seq 512 --ms 4,16 --rounds 2 \
                --steps 3 --name frozen_bottom_gpu  # round 36: no backward below the lowest trained layer
              python3 benchmarks/lora.py --device cuda --rounds 2 --steps 4 --name lora_gpu ;;  # LoRA vs PyTorch
    storage) python3 benchmarks/storage.py --quick --backend posix --name storage_posix_gpu
             # kvikio only where it can run (the package and the CUDA driver)
             if python3 -c "import sys; from snake.io.kvikio_file import kvikio_usable; sys.exit(not kvikio_usable())"; then
               python3 benchmarks/storage.py --quick --backend kvikio --name storage_kvikio_gpu
             else echo "kvikio not usable here: its storage run skipped"; fi ;;
    *) echo "cuda_suite.sh: unknown part '$1' (use tests, train, overlap, allcpu, kernels, throughput, storage, setting_b, kinds or finetune)" >&2; exit 2 ;;
  esac
}
failed=()
for part in "${parts[@]}"; do
  echo "== $part"
  # a failing part (a CUDA test, one benchmark) is reported at the end and the parts after
  # it still run: the lease is short. (The subshell's status is read from $?, not tested by
  # an `if` or `||`, in which bash would ignore `set -e` inside it; in the foreground, so
  # that Ctrl-C stops it too.)
  set +e
  (set -euo pipefail; run_part "$part")
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    failed+=("$part")
    echo "== $part FAILED (going on)"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "cuda_suite.sh: failed parts: ${failed[*]}" >&2
  exit 1
fi
