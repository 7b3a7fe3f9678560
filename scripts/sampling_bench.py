"""Decode speed with the draw on the device vs on the host (median of repeats):

    python scripts/sampling_bench.py MODEL.gguf [device] [prompt_tokens] [gen_tokens] [repeats]

For each sampler setting, a fresh session prefills a prompt and then decodes gen_tokens:
  device: session.step(token, logits=None, sampler=sp)  -> only the token id comes back
  host:   sp.sample(session.step(token).logits[-1])     -> the logits row comes back
Prints tokens/s for both, per setting."""
import statistics
import sys
import time

import numpy as np

import qwencuda as qc

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "T0.7 top_p0.9": dict(temperature=0.7, top_p=0.9),
    "T0.8 top_k40 top_p0.95 min_p0.05 pen1.1": dict(temperature=0.8, top_k=40, top_p=0.95,
                                                    min_p=0.05, repeat_penalty=1.1),
}


def one_round(model, ids, gen, params, on_device):
    sp = qc.Sampler(model.config.n_vocab, seed=1, **params)
    with model.session(len(ids) + gen + 1) as s:
        if on_device:
            token = s.prefill(ids, logits=None, sampler=sp).token
        else:
            token = sp.sample(s.prefill(ids).logits[-1])
        t0 = time.perf_counter()
        for _ in range(gen):
            sp.accept(token)
            if on_device:
                token = s.step(token, logits=None, sampler=sp).token
            else:
                token = sp.sample(s.step(token).logits[-1])
        return gen / (time.perf_counter() - t0)


def main():
    path = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "auto"
    prompt = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    gen = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    with qc.Model(path, device=device) as m:
        ids = np.random.default_rng(0).integers(0, m.config.n_vocab, prompt).tolist()
        print(f"decode tok/s, {m.device}, prompt {prompt}, {gen} steps, median of {repeats}")
        for name, params in SETTINGS.items():
            figs = {}
            for where in ("device", "host"):
                one_round(m, ids, 8, params, where == "device")   # warm-up (records the step)
                figs[where] = statistics.median(one_round(m, ids, gen, params, where == "device")
                                                for _ in range(repeats))
            print(f"  {name:42s} draw on device {figs['device']:7.1f}   on host {figs['host']:7.1f}")


if __name__ == "__main__":
    main()
