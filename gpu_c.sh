set -x
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=. timeout 200 python3 experiments/moe_prefill_decoded.py --tokens --model-ab none --model qwen3.5-35b-a3b 2>&1 | grep -v Warn | tail -4
mkdir -p $OUT/keep && cp $OUT/moe-prefill-decoded/*.json $OUT/keep/35b.json
PYTHONPATH=. timeout 200 python3 -m pytest -m gpu -n 6 -o addopts="" -p no:cacheprovider tests/test_moe.py tests/test_moe_routing.py tests/test_moe_packed.py tests/test_deltanet.py tests/test_lab_kernels.py -q -rfs 2>&1 | tail -3
