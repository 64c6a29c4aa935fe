set -x
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=.
git log -1 --format=%h
timeout 340 python3 experiments/moe_prefill_decoded.py --tokens 16384 --parts down_decoded --model-ab decoded_down --model qwen3.5-35b-a3b 2>&1 | tee $OUT/moe.log | grep -v "^\s*$" | tail -60
timeout 100 python3 experiments/conv_tiles.py > $OUT/conv.log 2>&1; tail -40 $OUT/conv.log
