#!/bin/bash
# one call (carry .gl .whl): attention forward with a lazy reference max: tests, bench vs SDPA, the 8B step + HF
source .gl/enter.sh || exit 3
L=$OUT/log.txt; t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader >> $L
timeout 120 python3 -m pytest -q -m tensorcore tests/test_gpu_attention_tc.py -s > $OUT/tests.txt 2>&1; echo "tests rc=$? t=$(( $(date +%s)-t0 ))" >> $L
grep -q "passed" $OUT/tests.txt && ! grep -q "failed" $OUT/tests.txt || { tail -30 $OUT/tests.txt >> $L; exit 0; }
timeout 100 python3 bench/attention.py --seq 1024 --batch 4 --heads 32 --kv-heads 8 --head-dim 128 --no-f32 > $OUT/attn.jsonl 2>> $L; echo "attn rc=$? t=$(( $(date +%s)-t0 ))" >> $L
S="--shape llama8b --batch 4 --seq 1024 --precision int8 --repeats 3 --steps 2"
timeout 220 python3 bench/train_step.py $S --sides ours,hf-bf16 --teacher-sides ours,hf-bf16 --profile > $OUT/hf.jsonl 2>> $L; echo "ours+hf rc=$? t=$(( $(date +%s)-t0 ))" >> $L
grep -h '"train_step"\|teacher_topk\|summary' $OUT/hf.jsonl | cut -c1-300 >> $L
cut -c1-400 $OUT/attn.jsonl >> $L
grep "T=\|passed\|failed" $OUT/tests.txt >> $L
