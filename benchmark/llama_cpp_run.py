"""One llama.cpp run in a process of its own, for bench.py --as-user: load a GGUF file, feed it the
prompt's token ids, decode greedily, and print its decode rate the way generate.py does.

    python -m benchmark.llama_cpp_run FILE.gguf '[1, 2, 3]' NEW_TOKENS THREADS
"""

import json
import sys
import time


def main(argv: list[str]) -> int:
    import numpy as np
    from llama_cpp import Llama

    gguf, prompt, new_tokens, threads = argv[0], json.loads(argv[1]), int(argv[2]), int(argv[3])
    n_ctx = len(prompt) + new_tokens
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.eval(prompt)
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    print(llm.detokenize([token]).decode(errors="replace") or " ", end="", flush=True)  # the first token, as generate.py streams it
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    print(f"decode: {(new_tokens - 1) / (time.perf_counter() - start):.1f} tok/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
