#!/usr/bin/env bash
# The one prepared check for a machine with CUDA: the CUDA tests, then bench.py on CUDA in each mode
# (CUDA graph, int8 and int4 weights, the paged cache, continuous batching, tensor parallelism when
# there are 2 GPUs), and one table of what came out. Sized for under 8 minutes on one GPU.
#
#     bash benchmark/gpu_check.sh [OUT_DIR]
#
# The model is SmolLM2-135M's shape with random weights in bfloat16 (no download, nothing to carry):
# decode speed depends on the shapes, not on the values. Each bench.py run writes its JSON to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
python=${PYTHON:-python3}

echo "== CUDA tests"
$python -m pytest -q tests/test_cuda.py 2>&1 | tail -n 15
echo "tests exit code: ${PIPESTATUS[0]}"

model="$out/smollm2-shape"
$python - "$model" <<'EOF'
import sys
import torch
import transformers

config = transformers.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
EOF

bench() {  # NAME ARGS...: one bench.py run, its JSON kept as NAME.json
    local name=$1
    shift
    echo "== bench.py $name"
    timeout 150 $python bench.py --checkpoint "$model" --device cuda --dtype bfloat16 --compare none --trials 3 --json "$out/$name.json" "$@" 2>&1 | tail -n 3
}
bench graph
bench int8 --quant int8
bench int4 --quant int4
bench paged --paged
bench continuous --workload 16 --workload-prompt-len 32-512 --workload-new-tokens 32-256 --max-batch 8
if [ "$($python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "== bench.py under torchrun, 2 ranks"
    timeout 150 $python -m torch.distributed.run --nproc-per-node 2 bench.py --checkpoint "$model" --device cuda --dtype bfloat16 \
        --trials 3 --json "$out/parallel.json" 2>&1 | tail -n 3
fi

echo "== one table ($out)"
$python - "$out" <<'EOF'
import json
import sys
from pathlib import Path

print("| run | decode tok/s | TTFT s | peak MiB |")
print("|---|---|---|---|")
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    data = json.loads(path.read_text())
    for system in ("engine", "engine_paged", "engine_continuous", "engine_static"):
        figures = data.get(system)
        if isinstance(figures, dict):
            rate = figures.get("decode_tok_s", figures.get("tok_s"))
            ttft = figures.get("ttft_s")
            print(f"| {path.stem}: {system} | {rate:.1f} | {'' if ttft is None else f'{ttft:.3f}'} | {figures.get('peak_mem_mib', 0):.0f} |")
EOF
