"""Decode tokens/s of llama.cpp (through llama-cpp-python, dev-side only) on a GGUF file: the
yardstick of bench/infer.sh. Evaluates a short prompt, then N tokens one at a time, each the
greedy choice of the last logits, and prints tokens per second of those N.
    python bench/infer_llama_cpp.py model.gguf THREADS N"""
import sys
import time

import numpy as np
from llama_cpp import Llama


def main():
    path, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=256, n_batch=64, verbose=False)
    llm.eval(llm.tokenize(b"Once upon a time", add_bos=True))
    t0 = time.perf_counter()
    for _ in range(n):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))  # the last token's
        tok = int(np.argmax(logits))
        llm.eval([tok])
    print(f"{n / (time.perf_counter() - t0):.1f}")


if __name__ == "__main__":
    main()
