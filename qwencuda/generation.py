"""Text in, text out: prefill a prompt, then sample one token at a time until a stop condition.

This is the loop every inference engine has, written plainly on top of the public pieces
(Model.session, Tokenizer, Sampler), so that its output is the engine's output and nothing
else: greedy (temperature 0) is a pure argmax and gives the same tokens on every run.

Stop conditions, in the order they are checked after each token (Generation.stop_reason):
  "eos"      the model chose an end-of-generation token (eos, <|im_end|>, <|endoftext|>); it is
             the last entry of Generation.tokens but its text is not part of Generation.text
  "stop"     the text contains one of the `stop` strings; the text ends just before it
  "length"   max_new_tokens were generated
  "context"  the session's context is full (the prompt itself must fit: else ValueError
             before any work)
  "cancelled" a stream was closed before it finished

Streaming yields text pieces that never split a UTF-8 character (the tokenizer's stream
decoder) and never show text that a stop string later removes: text that might be the start
of a stop string is held back until the next token decides. The pieces of a stream concatenate
to exactly Generation.text, because the non-streaming call consumes the very same stream.

What the engine saw, per generated token (asked for with capture= and logprobs=k; without
them every token is drawn on the device and only its id comes back):
  Generation.traces[i]    the Trace of the forward pass whose last position's logits chose
                          tokens[i] (as HF's generate(output_attentions=True) counts them):
                          [0] is the prefill of the whole prompt (one call, so that the trace
                          covers it all), [i >= 1] the step that fed tokens[i - 1] at position
                          len(prompt) + i - 1, whose attention spans len(prompt) + i keys
  Generation.logprobs[i]  a TokenLogprobs for tokens[i]: log_softmax of those same logits, in
                          float64 from the engine's float32 row: the model's own distribution,
                          before the repetition penalty, top-k/top-p/min-p and temperature
The lists have one entry per token from the moment the token exists, also while streaming
(GenerationStream.tokens / .logprobs / .traces are the very lists the result gets).
patch= (qwencuda.patching) changes tensors in every one of those passes: the generation, its
logprobs and its traces are then the patched run's.
"""
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from .chat import render_for

# Token texts that end a generation when the model emits them (with the file's eos id).
END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>")

PREFILL_CHUNK = 512   # prompt tokens per prefill call; a progress bar counts these


@dataclass
class Generation:
    """What one generate() call produced, and how fast."""

    text: str
    tokens: list                      # generated ids (ending with the eos id when stop_reason is "eos")
    prompt_tokens: list               # the prompt as fed to the model
    stop_reason: str                  # "eos" | "stop" | "length" | "context" | "cancelled"
    prefill_tokens_per_s: float       # prompt tokens / prefill time
    decode_tokens_per_s: float        # generated tokens / decode time (0.0 when none)
    timings: dict = field(default_factory=dict)   # seconds: prefill_s, decode_s, total_s; counts
    logprobs: list = None             # a TokenLogprobs per token with logprobs=k, else None
    traces: list = None               # a Trace per token with capture=, else None (module doc)

    def __str__(self):
        return self.text


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability, and the k most likely tokens of the same step."""

    token: int                        # the generated id
    text: str                         # its text alone (U+FFFD for part of a UTF-8 character)
    logprob: float                    # log P(token) under the model (natural log)
    top: tuple = ()                   # ((id, text, logprob), ...) k of them, most likely first,
                                      # equal logprobs in id order; may or may not hold token


def log_softmax(logits) -> np.ndarray:
    """float64 log-probabilities of one row of logits. NaN counts as -inf (as for the sampler)."""
    x = np.array(logits, dtype=np.float64).reshape(-1)   # a copy: changed in place below
    nan = np.isnan(x)
    if nan.any():
        x[nan] = -np.inf
    top = np.max(x)
    x -= top + np.log(np.sum(np.exp(x - top)))
    return x


def _top_ids(lp, k) -> np.ndarray:
    """The k largest entries of lp, largest first, ties by lower id; without sorting the whole
    vocabulary (a partition, then a sort of k)."""
    n = lp.size
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k < n:
        kth = np.partition(lp, n - k)[n - k]
        above = np.flatnonzero(lp > kth)
        cand = np.concatenate([above, np.flatnonzero(lp == kth)[:k - above.size]])
    else:
        cand = np.arange(n)
    return cand[np.lexsort((cand, -lp[cand]))]


def token_logprobs(tokenizer, logits, token, k) -> TokenLogprobs:
    """The TokenLogprobs of `token` drawn from one row of logits, with the top k."""
    lp = log_softmax(logits)
    top = tuple((int(i), tokenizer.decode([int(i)]), float(lp[i])) for i in _top_ids(lp, k))
    return TokenLogprobs(token=int(token), text=tokenizer.decode([int(token)]),
                         logprob=float(lp[token]), top=top)


class GenerationStream:
    """An iterator of text pieces; `.result` holds the Generation once it is exhausted
    (or closed: then stop_reason is "cancelled").

    While it runs, `.tokens` (and with logprobs=k `.logprobs`, with capture= `.traces`, else
    None) hold one entry per token generated so far: at each piece, every token whose text is
    in the pieces so far and any whose text is still held back. They are the result's lists."""

    def __init__(self, run, logprobs=False, traces=False):
        """run(stream) -> a generator of pieces that fills the lists and sets stream.result when
        it ends."""
        self.result = None
        self.tokens = []
        self.logprobs = [] if logprobs else None
        self.traces = [] if traces else None
        self._gen = run(self)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._gen)

    def close(self):
        """Stop generating now (frees the session); `.result` then holds what was made."""
        self._gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class _Plan:
    """Everything generate() checked up front, so that errors come before any work."""

    ids: list
    max_new_tokens: int
    max_context: int
    sampler_kwargs: dict
    stops: tuple
    eog: frozenset
    progress: bool
    logprobs: int = None              # top-k of TokenLogprobs, or None: no logits come back
    evals: dict = field(default_factory=dict)   # capture=, patch=, capture_device= for every call


def _eog_ids(tok) -> frozenset:
    ids = set()
    if getattr(tok, "eos_id", None) is not None and tok.eos_id >= 0:
        ids.add(int(tok.eos_id))
    special = getattr(tok, "special_ids", None) or {}
    for text in END_OF_GENERATION:
        if text in special:
            ids.add(int(special[text]))
    return frozenset(ids)


def _normalize_stop(stop) -> tuple:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    stops = tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty str, got {s!r}")
    return stops


def _prompt_ids(model, prompt, allow_special, chat, system) -> list:
    tok = model.tokenizer
    if chat:
        if not isinstance(prompt, str):
            raise ValueError("chat=True takes the prompt as a str (the user message)")
        if not allow_special:
            raise ValueError("chat=True needs allow_special=True (the template's tokens are special)")
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": prompt})
        prompt = render_for(tok, messages, add_generation_prompt=True)
    elif system is not None:
        raise ValueError("system= is only used with chat=True")
    if isinstance(prompt, (str, bytes)):
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return [int(t) for t in tok.encode(prompt, allow_special=allow_special)]
    try:
        ids = [int(t) for t in prompt]
    except TypeError:
        raise TypeError("prompt must be a str or a list of token ids") from None
    if not ids:
        raise ValueError("the prompt is empty")
    n_vocab = model.config.n_vocab
    bad = [t for t in ids if t < 0 or t >= n_vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is out of range [0, {n_vocab})")
    return ids


def _check_logprobs(logprobs, n_vocab):
    if logprobs is None:
        return None
    if isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer)) or logprobs < 0:
        raise ValueError(f"logprobs must be an int >= 0 (how many top alternatives per token; "
                         f"0: the chosen token's only) or None, got {logprobs!r}")
    if logprobs > n_vocab:
        raise ValueError(f"logprobs={logprobs} is more than the vocabulary ({n_vocab} tokens)")
    return int(logprobs)


def _check_capture(model, capture):
    """capture -> the patterns (a tuple) or None, checked against the model's capture names
    by the check Model.forward uses."""
    if capture is None:
        return None
    from .model import _patterns

    return _patterns(capture, model.capture_names())


def _check_patch(model, patch):
    """patch -> itself, after the check Session.prefill makes (names, edit kinds), so that a bad
    one fails before any work."""
    if patch is not None:
        from .patching import as_hook

        as_hook(patch, model.capture_names(), model.config.n_head)
    return patch


def _check_capture_device(model, capture_device):
    """capture_device -> whether captures stay on the GPU, by the check Session.prefill makes."""
    from .model import _capture_device

    return _capture_device(capture_device, model.device)


def _plan(model, prompt, max_new_tokens, temperature, top_k, top_p, min_p, repeat_penalty,
          repeat_last_n, seed, stop, allow_special, chat, system, progress, max_context,
          capture=None, logprobs=None, patch=None, capture_device="cpu") -> _Plan:
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    logprobs = _check_logprobs(logprobs, model.config.n_vocab)
    patterns = _check_capture(model, capture)
    on_device = _check_capture_device(model, capture_device)
    patch = _check_patch(model, patch)
    sampler_kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
    from .sampling import Sampler

    Sampler(1, **sampler_kwargs)   # the sampler's checks (the one place for them), before any work
    stops = _normalize_stop(stop)
    ids = _prompt_ids(model, prompt, allow_special, chat, system)
    n_ctx_train = int(getattr(model.config, "n_ctx_train", 0) or 0)
    if max_context is None:
        want = len(ids) + max(int(max_new_tokens), 1)
        max_context = min(want, n_ctx_train) if n_ctx_train > 0 else want
    elif int(max_context) < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context!r}")
    max_context = int(max_context)
    if len(ids) > max_context:
        limit = "the model's context" if max_context == n_ctx_train else "max_context"
        raise ValueError(f"the prompt has {len(ids)} tokens, more than {limit} ({max_context})")
    return _Plan(
        ids=ids, max_new_tokens=int(max_new_tokens), max_context=max_context,
        sampler_kwargs=sampler_kwargs,
        stops=stops, eog=_eog_ids(model.tokenizer), progress=bool(progress),
        logprobs=logprobs,
        evals={k: v for k, v in (("capture", patterns), ("patch", patch),
                                 ("capture_device", capture_device if on_device and patterns else None))
               if v is not None},
    )


def _held_back(text, stops) -> int:
    """How many trailing characters of text could still be the start of a stop string."""
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:n]):
                keep = n
                break
    return keep


def _first_stop(text, stops) -> int:
    """Index of the earliest stop string in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def _prefill(session, ids, progress, sampler, logits, evals):
    """Feed the prompt; return the last call's Trace, whose .token is the first token the
    sampler draws after it (no sampler: nothing is drawn, logits and evals are not used)."""
    if sampler is None:
        logits, evals = None, {}
    # in chunks that a progress bar counts, but in one call when capturing (or patching): the
    # trace covers the whole prompt, row i is prompt token i (the session splits it anyway)
    size = len(ids) if evals else PREFILL_CHUNK
    chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
    with tqdm(total=len(ids), unit="tok", desc="prefill", file=sys.stderr, leave=False,
              disable=not (progress and len(chunks) > 1)) as bar:
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            # the lm_head and the draw run once, on the device, after the last chunk
            tr = (session.prefill(chunk, logits=logits, sampler=sampler, **evals) if last else
                  session.prefill(chunk, logits=None))
            bar.update(len(chunk))
    return tr


def _make_sampler(model, kwargs):
    from .sampling import Sampler

    return Sampler(model.config.n_vocab, **kwargs)


def _run(model, plan, stream_obj):
    """The generation loop, as a generator of text pieces; sets stream_obj.result at the end."""
    tok = model.tokenizer
    tokens, logprobs, traces = stream_obj.tokens, stream_obj.logprobs, stream_obj.traces
    pieces = []
    reason = "cancelled"
    held = ""
    t_start = time.perf_counter()
    prefill_s = decode_s = 0.0
    session = None
    # the fast path unless asked for more: no logits download, no capture (a replayed step)
    logits = "last" if plan.logprobs is not None else None

    def emit(text):
        pieces.append(text)
        return text

    try:
        session = model.session(max_context=plan.max_context)
        sampler = _make_sampler(model, plan.sampler_kwargs)
        for t in plan.ids:   # the repetition penalty sees the prompt
            sampler.accept(t)
        decoder = tok.stream_decoder()
        t0 = time.perf_counter()
        # every token is drawn on the session's device (from the same logits whether or not
        # they also come back): tr.token is the next token, tr the pass that chose it
        tr = _prefill(session, plan.ids, plan.progress, sampler if plan.max_new_tokens else None,
                      logits, plan.evals)
        prefill_s = time.perf_counter() - t0
        if plan.max_new_tokens == 0:
            reason = "length"
        while reason == "cancelled":
            t0 = time.perf_counter()
            token = int(tr.token)
            sampler.accept(token)
            tokens.append(token)
            if logprobs is not None:
                logprobs.append(token_logprobs(tok, tr.logits[-1], token, plan.logprobs))
            if traces is not None:
                traces.append(tr)
            out = None
            if token in plan.eog:
                reason = "eos"
            else:
                held += decoder.push(token)
                cut = _first_stop(held, plan.stops) if plan.stops else -1
                if cut >= 0:
                    held, reason = held[:cut], "stop"
                elif len(tokens) >= plan.max_new_tokens:
                    reason = "length"
                elif session.position >= session.max_context:
                    reason = "context"
                else:
                    keep = _held_back(held, plan.stops) if plan.stops else 0
                    out, held = held[:len(held) - keep], held[len(held) - keep:]
                    tr = session.step(token, logits=logits, sampler=sampler, **plan.evals)
            decode_s += time.perf_counter() - t0
            if out:
                yield emit(out)
        if reason != "stop":
            held += decoder.flush()
            cut = _first_stop(held, plan.stops) if plan.stops else -1
            if cut >= 0:
                held, reason = held[:cut], "stop"
        if held:
            text, held = held, ""
            yield emit(text)
    finally:
        if session is not None and hasattr(session, "close"):
            session.close()
        total_s = time.perf_counter() - t_start
        stream_obj.result = Generation(
            text="".join(pieces), tokens=tokens, prompt_tokens=list(plan.ids),
            stop_reason=reason, logprobs=logprobs, traces=traces,
            prefill_tokens_per_s=len(plan.ids) / prefill_s if prefill_s > 0 else 0.0,
            decode_tokens_per_s=len(tokens) / decode_s if decode_s > 0 and tokens else 0.0,
            timings={"prefill_s": prefill_s, "decode_s": decode_s, "total_s": total_s,
                     "prompt_tokens": len(plan.ids), "generated_tokens": len(tokens)},
        )


def generate(model, prompt, max_new_tokens=256, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
             repeat_penalty=1.0, seed=0, stop=None, stream=False, allow_special=True, chat=False,
             system=None, progress=False, max_context=None, repeat_last_n=64, capture=None,
             logprobs=None, patch=None, capture_device="cpu"):
    """Generate text after a prompt with a qwencuda Model.

    prompt: a str (tokenized with special tokens recognised when allow_special) or a list of
    token ids. chat=True wraps a str prompt as one user message (after `system`, else the
    template's default system prompt) in the file's chat template. Sampling parameters are
    the Sampler's (temperature 0: greedy). stop: a str or list of str that end the text.
    max_context: the session's size (default: prompt + max_new_tokens, at most the model's
    training context). progress: a tqdm bar (stderr) over the prefill of long prompts.
    capture: capture name pattern(s) as Model.forward takes them: Generation.traces gets one
    Trace per generated token (module doc). logprobs: an int k >= 0: Generation.logprobs gets
    one TokenLogprobs per generated token with the k most likely alternatives. Neither changes
    the tokens drawn; without them no logits leave the device. patch: {capture name or glob:
    edit} as Session.prefill takes it (qwencuda.patching), applied in every call: the prompt's
    prefill and each step (rows count within the call); the tokens are drawn from the patched
    logits, and logprobs and traces show the patched run. capture_device: "cpu" (NumPy
    captures, default) or "cuda": the traces' captured tensors stay in GPU memory as
    qwencuda.DeviceArray objects (as Session.prefill takes it; ValueError on the CPU).

    Returns a Generation, or with stream=True a GenerationStream of text pieces whose
    `.result` is the Generation after the last piece. Bad arguments and prompts that do not
    fit raise ValueError at call time, before any work (also with stream=True)."""
    plan = _plan(model, prompt, max_new_tokens, temperature, top_k, top_p, min_p,
                 repeat_penalty, repeat_last_n, seed, stop, allow_special, chat, system,
                 progress, max_context, capture=capture, logprobs=logprobs, patch=patch,
                 capture_device=capture_device)
    it = GenerationStream(lambda stream: _run(model, plan, stream),
                          logprobs=plan.logprobs is not None, traces=bool(plan.evals.get("capture")))
    if stream:
        return it
    for _ in it:
        pass
    return it.result
