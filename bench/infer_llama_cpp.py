"""tokens/s of llama.cpp (through llama-cpp-python, dev-side only) on a GGUF file: the yardstick of
bench/infer.sh, measured as ./generate measures itself.
    python bench/infer_llama_cpp.py model.gguf THREADS N [decode|prefill|long] [prompt.txt]
decode:  evaluates "Once upon a time", then N tokens one at a time, each the greedy choice of the
         last logits; tokens/s of those N.
prefill: the prompt file's tokens (with BOS) evaluated as one batch (n_batch = n_ubatch = 1024,
         logits of the last token only, as generate); tokens/s of the batch, the best of 4 runs
         after one warm-up (the cache cleared between).
long:    the prompt evaluated, then N tokens decoded as above."""
import sys
import time

import numpy as np
from llama_cpp import Llama


def decode(llm, n):
    t0 = time.perf_counter()
    for _ in range(n):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))  # the last token's
        llm.eval([int(np.argmax(logits))])
    return n / (time.perf_counter() - t0)


def main():
    path, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "decode"
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=1024, n_ubatch=1024, verbose=False)
    if mode == "decode":
        llm.eval(llm.tokenize(b"Once upon a time", add_bos=True))
        print(f"{decode(llm, n):.1f}")
        return
    with open(sys.argv[5], "rb") as f:
        toks = llm.tokenize(f.read().strip(), add_bos=True)
    if mode == "prefill":
        best = 0.0
        for r in range(5):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(toks)
            if r > 0:
                best = max(best, len(toks) / (time.perf_counter() - t0))
        print(f"{best:.1f}")
        return
    llm.eval(toks)
    print(f"{decode(llm, n):.1f}")


if __name__ == "__main__":
    main()
