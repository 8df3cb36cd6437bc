"""A long compressed generation: does the resident set stay flat, and decode speed with it?

    python -m results.long_run --checkpoint checkpoints/SmolLM2-135M-Instruct --new-tokens 32768
    python -m results.long_run --checkpoint checkpoints/SmolLM2-135M-Instruct --policy streaming --kv-store 1024

Generates with a KV policy (BeaconKV by default; budget 512, hysteresis 128, window 32), with or
without a store of demoted slots (--kv-store, int4) and no EOS, in bfloat16, eager (or --compile);
every 1024 tokens it prints the resident set (VmRSS) and the decode tok/s of those tokens.
SmolLM2 knows 8192 positions: --rope-factor F runs it with dynamic NTK RoPE scaling over F times
as many (a copy of the checkpoint's config; the text quality past 8192 is not the point here).
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from compression.config import CompressionConfig
from engine.options import RunOptions, generate
from engine.sampling import SamplingConfig
from weights.forms import load_model
from weights.tokenizer import Tokenizer


def resident_mib() -> float:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--new-tokens", type=int, default=32768)
    p.add_argument("--rope-factor", type=float, default=5.0)
    p.add_argument("--every", type=int, default=1024)
    p.add_argument("--policy", default="beacon")
    p.add_argument("--kv-store", type=int, default=0, metavar="SLOTS", help="demote evictions into a store of this many slots (0: none)")
    p.add_argument("--compile", action="store_true", help="compile the decode step (default: eager)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        shutil.copytree(args.checkpoint, folder)
        config = json.loads((folder / "config.json").read_text())
        config["rope_scaling"] = {"rope_type": "dynamic", "factor": args.rope_factor}
        (folder / "config.json").write_text(json.dumps(config))
        model = load_model(folder, torch.bfloat16, torch.device("cpu"))
        tokenizer = Tokenizer.from_dir(folder)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Write a very long story about a lighthouse keeper."}])
    policy = CompressionConfig(policy=args.policy, budget=512, hysteresis=128, window=32, store_slots=args.kv_store)
    sampling = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    marks: list[tuple[int, float, float]] = []  # (tokens, seconds, resident MiB)
    count = [0]

    def on_tokens(_: dict[int, int | None]) -> None:
        count[0] += 1
        if count[0] % args.every == 0:
            marks.append((count[0], time.perf_counter(), resident_mib()))
            n, t, rss = marks[-1]
            rate = args.every / (t - marks[-2][1]) if len(marks) > 1 else float("nan")
            print(f"{n:6d} tokens  resident {rss:7.1f} MiB  decode {rate:5.1f} tok/s", flush=True)

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU kernels {torch.backends.cpu.get_cpu_capability()}; resident before: {resident_mib():.1f} MiB", flush=True)
    with torch.inference_mode():
        result = generate(model, [prompt], args.new_tokens, eos_ids=frozenset(), sampling=sampling, on_tokens=on_tokens, options=RunOptions(compression=policy, compile=args.compile))
    stats = result.compression
    print(f"{result.new_tokens} tokens, {stats.compactions} compactions, KV cache {result.kv_cache_bytes / 2**20:.1f} MiB (its store included), "
          f"decode {result.decode_steps / result.decode_s:.1f} tok/s overall")


if __name__ == "__main__":
    main()
