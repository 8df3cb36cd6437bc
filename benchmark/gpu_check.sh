#!/usr/bin/env bash
# The one prepared check for a machine with an NVIDIA GPU. Run it from anywhere, with nothing but
# this repository, Python 3.10+ and (if packages are missing) the package registry:
#
#     bash benchmark/gpu_check.sh [OUT_DIR]          # PYTHON=python3.12 to pick the interpreter
#
# It installs what is missing (a CUDA build of torch, the engine's dependencies; flash-attn only if
# a prebuilt wheel installs, else decode attention runs SDPA), runs the CUDA tests, then bench.py on
# CUDA in each mode (CUDA graph, int8 and int4 weights, the paged cache, continuous batching, tensor
# parallelism when there are 2 GPUs), and ends with one table: a row per step, passed / failed /
# skipped and why, each bench's decode rate and the attention path it ran. Every step has a time
# limit and the whole run stops by 8 minutes. Logs and bench.py's JSON go to OUT_DIR.
#
# The model is SmolLM2-135M's shape with random weights in bfloat16 (no download): decode speed
# depends on the shapes, not on the values.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
python=${PYTHON:-python3}
deadline=$((SECONDS + 470))
: >"$out/steps.tsv"

record() {  # NAME STATUS WHY
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$out/steps.tsv"
    echo "== $1: $2${3:+ ($3)}"
}

step() {  # NAME LIMIT_S CMD...: run CMD under a time limit (cut to what is left of the 8 minutes), logged to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 15 ]; then
        record "$name" skipped "out of the 8 minutes"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit} s)"
    local rc=0
    timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
        record "$name" passed ""
    elif [ "$rc" -eq 124 ]; then
        record "$name" failed "over its ${limit} s"
    else
        record "$name" failed "exit $rc: $(grep -v '^\s*$' "$out/$name.log" | tail -n 1 | cut -c1-150)"
    fi
}

missing() {  # the modules among the arguments that this Python cannot import
    "$python" - "$@" <<'EOF'
import importlib.util
import sys

print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}

# 1. torch with CUDA: without it nothing below can run, so a failure here stops the script.
if [ -n "$(missing torch)" ]; then
    echo "== installing torch (a CUDA build)"
    timeout 300 "$python" -m pip install --quiet --retries 1 --timeout 15 torch
fi
"$python" -c 'import sys, torch; ok = torch.cuda.is_available(); print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0) if ok else "no CUDA device"); sys.exit(0 if ok else 1)' \
    | tee "$out/device.txt"
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')

# 2. What the engine and its tests import; a registry out of reach leaves what is there.
set +e
need=$(missing safetensors tokenizers jinja2 gguf tqdm huggingface_hub fastapi uvicorn transformers pytest)
if [ -n "$need" ]; then
    step install 180 "$python" -m pip install --quiet --retries 1 --timeout 15 $need
else
    record install passed "all there"
fi
if [ -n "$(missing flash_attn)" ]; then
    if timeout 120 "$python" -m pip install --quiet --retries 1 --timeout 15 --only-binary=:all: 'flash-attn>=2.6.3,<2.8.4' >"$out/flash-attn.log" 2>&1; then
        record flash-attn passed "installed from a prebuilt wheel"
    else
        record flash-attn skipped "no prebuilt wheel installs here: decode attention runs SDPA"
    fi
else
    record flash-attn passed "already installed"
fi

# 3. The CUDA tests, then the rules that hold on every machine.
step tests 200 "$python" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_rules.py

# 4. bench.py on CUDA, one run per mode.
model="$out/smollm2-shape"
step model 60 "$python" - "$model" <<'EOF'
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
bench() {  # NAME ARGS...
    local name=$1
    shift
    if [ ! -f "$model/config.json" ]; then
        record "bench-$name" skipped "no model (step model failed)"
        return 0
    fi
    step "bench-$name" 75 "$python" bench.py --checkpoint "$model" --device cuda --dtype bfloat16 --compare none --trials 3 --json "$out/bench-$name.json" "$@"
}
bench graph
bench int8 --quant int8
bench int4 --quant int4
bench paged --paged
bench continuous --workload 16 --workload-prompt-len 32-512 --workload-new-tokens 32-256 --max-batch 8
if [ "$gpus" -ge 2 ]; then
    step bench-parallel 90 "$python" -m torch.distributed.run --nproc-per-node 2 bench.py --checkpoint "$model" --device cuda --dtype bfloat16 \
        --trials 3 --json "$out/bench-parallel.json"
else
    record bench-parallel skipped "one GPU: tensor parallelism needs 2"
fi
set -e

# 5. One table: every step, and each bench's figures.
"$python" - "$out" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"\n{(out / 'device.txt').read_text().strip()}\n")
print("| step | result | why | decode tok/s | TTFT s | peak MiB | attention |")
print("|---|---|---|---|---|---|---|")
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, why = (line.split("\t") + ["", ""])[:3]
    rate = ttft = peak = attention = ""
    data_file, log = out / f"{name}.json", out / f"{name}.log"
    if data_file.exists():
        data = json.loads(data_file.read_text())
        if "ranks" in data:
            data = {"engine": data["ranks"][0]}
        for system in ("engine", "engine_paged", "engine_continuous", "engine_static"):
            figures = data.get(system)
            if isinstance(figures, dict):
                value = figures.get("decode_tok_s", figures.get("tok_s"))
                rate = "" if value is None else f"{value:.1f}"
                ttft = "" if figures.get("ttft_s") is None else f"{figures['ttft_s']:.3f}"
                peak = "" if figures.get("peak_mem_mib") is None else f"{figures['peak_mem_mib']:.0f}"
                break
    if log.exists():
        attention = next((l.split("attention: ", 1)[1] for l in log.read_text().splitlines() if "attention: " in l), "")
    print(f"| {name} | {status} | {why} | {rate} | {ttft} | {peak} | {attention} |")
EOF
! grep -q $'\tfailed\t' "$out/steps.tsv"
