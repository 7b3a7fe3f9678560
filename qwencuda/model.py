"""Model and Session: a Qwen2 GGUF file on the CPU or a CUDA GPU, with a KV cache and capture.

    m = qwencuda.Model("model.gguf", device="cpu")
    tr = m.forward(ids, capture="blk.*.attn_probs")    # a Trace
    s = m.session(); s.prefill(ids); s.step(token)

A thin layer over qwencuda._core.Model / Session (csrc/python/py_model.c): it validates arguments,
checks capture patterns against the capture names, and wraps results in Traces.
"""
import fnmatch
import os
import re
from dataclasses import dataclass

import numpy as np

from . import _core, patching
from .trace import Trace, capture_names

DEFAULT_MAX_CONTEXT = 4096

# The capture budget new sessions start with (bytes; None: half of the memory available at each
# eval). qwencuda.set_capture_budget sets it; Session.capture_budget overrides it per session.
_capture_budget = None


def set_capture_budget(nbytes):
    """Bytes of host memory one eval may fill with captures and logits before it raises
    MemoryError (nothing allocated, nothing run), for sessions made from now on (Model.forward's
    too); the same number bounds, on its own, the GPU memory of captures kept on the device
    (capture_device="cuda"). None restores the default: half of the memory the system has
    available at the time of each eval, and half of the GPU's free memory for device captures."""
    global _capture_budget
    if nbytes is not None:
        if isinstance(nbytes, bool) or int(nbytes) != nbytes or nbytes < 1:
            raise ValueError(f"capture budget must be a positive number of bytes or None, got {nbytes!r}")
        nbytes = int(nbytes)
    _capture_budget = nbytes


def _kv_type(kv_type, device):
    """None: F16 on CUDA (half the memory, the tensor-core attention), F32 on the CPU."""
    if kv_type is None:
        return "f16" if device.startswith("cuda") else "f32"
    if kv_type not in ("f16", "f32"):
        raise ValueError(f"kv_type must be 'f16', 'f32' or None, got {kv_type!r}")
    return kv_type


def _device_ordinal(device):
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _capture_device(capture_device, device):
    """capture_device ("cpu", the default, or "cuda" / "cuda:N") for a model on `device` -> True
    when the captures stay in the model's GPU memory (qwencuda.DeviceArray), False for NumPy."""
    if capture_device is None or (isinstance(capture_device, str) and capture_device == "cpu"):
        return False
    if not isinstance(capture_device, str):
        raise TypeError(f"capture_device must be 'cpu' or 'cuda' (a str), not {type(capture_device).__name__}")
    if capture_device != "cuda" and not re.fullmatch(r"cuda:\d+", capture_device):
        raise ValueError(f"capture_device must be 'cpu' (NumPy arrays, the default) or 'cuda' / 'cuda:N' "
                         f"(the model's GPU), got {capture_device!r}")
    if not device.startswith("cuda"):
        raise ValueError(f"capture_device={capture_device!r} keeps captures in GPU memory, but this model "
                         f"runs on {device}: its captures are NumPy arrays (capture_device='cpu')")
    # "cuda" is the model's GPU, whichever it is; "cuda:N" must name it
    if capture_device != "cuda" and _device_ordinal(capture_device) != _device_ordinal(device):
        raise ValueError(f"capture_device={capture_device!r}: captures stay on the GPU of the model, "
                         f"{device}; copy them to another one in torch or CuPy")
    return True


def _attn_rows(attn_rows, n):
    """attn_rows (None, an int or ints; negative counts from the end) -> sorted unique int64 rows."""
    if attn_rows is None:
        return None
    a = np.asarray(attn_rows).reshape(-1)
    if a.size == 0:
        raise ValueError("attn_rows selects no query row (None: every row)")
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"attn_rows must be ints (query rows, negative from the end), got {a.dtype}")
    a = a.astype(np.int64)
    bad = a[(a < -n) | (a >= n)]
    if bad.size:
        raise ValueError(f"attn_rows: row {int(bad[0])} is not in [-{n}, {n}) for {n} tokens")
    return np.unique(np.where(a < 0, a + n, a))


@dataclass(frozen=True)
class Config:
    """Hyperparameters of a Qwen2 model, read from the GGUF metadata (model.h qc_config)."""

    arch: str            # general.architecture: "qwen2"
    n_vocab: int         # rows of token_embd.weight (151936 for Qwen2.5), not the tokenizer's count
    dim: int             # qwen2.embedding_length
    n_layer: int         # qwen2.block_count
    n_head: int          # qwen2.attention.head_count
    n_head_kv: int       # qwen2.attention.head_count_kv
    head_dim: int        # dim // n_head
    ffn_dim: int         # qwen2.feed_forward_length
    n_ctx_train: int     # qwen2.context_length
    rope_theta: float    # qwen2.rope.freq_base
    norm_eps: float      # qwen2.attention.layer_norm_rms_epsilon
    tied: bool           # no output.weight: the lm_head is token_embd.weight


def _resolve_device(device):
    if device is None or device == "auto":
        info = _core.build_info()
        return "cuda" if info["cuda"] and info["cuda_devices"] > 0 else "cpu"
    if not isinstance(device, str):
        raise TypeError(f"device must be a str ('cpu', 'cuda', 'cuda:N' or 'auto'), not {type(device).__name__}")
    return device


def _patterns(capture, names):
    """capture (None, a str or a list of str) -> a tuple of patterns, each matching some name."""
    if capture is None:
        return None
    pats = (capture,) if isinstance(capture, str) else tuple(capture)
    for p in pats:
        if not isinstance(p, str):
            raise TypeError(f"capture patterns must be str, not {type(p).__name__}")
        if not fnmatch.filter(names, p):
            some = ", ".join(names[i] for i in (0, 1, 3, 7, 8, len(names) - 2) if i < len(names))
            raise ValueError(f"capture pattern {p!r} matches no capture name (names look like: "
                             f"{some}; see Model.capture_names())")
    return pats or None


def _ids(ids):
    """A 1-D int array of token ids (their range is the engine's to check)."""
    if isinstance(ids, (str, bytes)):
        raise TypeError("ids must be token ids (ints); encode text with model.tokenizer.encode()")
    a = np.asarray(ids)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {a.shape}")
    if a.size == 0:
        raise ValueError("ids is empty: give at least one token id")
    if a.dtype == object:
        try:
            a = np.array([int(t) for t in a], dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise TypeError("ids must be ints") from None
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"ids must be ints, got {a.dtype}")
    return a.astype(np.int64, copy=False)


class Session:
    """A KV cache over a Model: prefill(ids), then step(token), each at the current position."""

    def __init__(self, model, max_context, kv_type=None, prefill_chunk=None):
        self._model = model
        kv_type = model.kv_type if kv_type is None else _kv_type(kv_type, model.device)
        self._s = model._core_model().session(int(max_context), kv_type)
        if prefill_chunk is not None:
            self._s.prefill_chunk = prefill_chunk
        if _capture_budget is not None:
            self._s.capture_budget = _capture_budget

    def _core(self):
        if self._s is None:
            raise ValueError("the session is closed")
        return self._s

    @property
    def position(self) -> int:
        """Tokens in the cache: the position of the next token."""
        return self._core().position

    @property
    def max_context(self) -> int:
        return self._core().max_context

    @property
    def closed(self) -> bool:
        return self._s is None or self._s.closed

    @property
    def kv_type(self) -> str:
        """The KV cache's element type: "f16" (the CUDA default) or "f32"."""
        return self._core().kv_type

    @property
    def last_path(self):
        """How the last eval ran: "ops" (op by op: every prefill, and every step that captures or
        patches), "graph" (a decode step recorded once as a CUDA graph and replayed) or
        "persistent" (the same, as CUDA's one-launch decode kernel: QWENCUDA_DECODE=persistent at
        session creation, for the models it serves). None before the first eval."""
        return self._core().last_path

    @property
    def ran_ahead(self) -> bool:
        """Whether the last eval's step was already running when it was asked for. A generation
        loop (step(token, logits=None, sampler=s) with the token the step before drew, the same
        sampler settings and no penalty history that changes) has its next step queued on the
        GPU before the host sees the token: the GPU never waits for Python between steps. The
        draw is the same either way; any other eval just runs after the queued step's work.
        QWENCUDA_DECODE_AHEAD=0 at session creation turns it off (to measure it)."""
        return self._core().ran_ahead

    @property
    def prefill_chunk(self) -> int:
        """Most tokens one forward pass computes; a longer prefill runs in chunks of this many
        (same result, bounded scratch memory). Settable."""
        return self._core().prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, n):
        self._core().prefill_chunk = n

    @property
    def capture_budget(self) -> int:
        """Bytes of host memory one eval's captures and logits may take (MemoryError beyond it),
        and, on its own, of GPU memory its device captures may take (capture_device="cuda").
        Set a number of bytes, or None for the default (half of the available memory; for device
        captures half of the GPU's free memory). Reading it gives the host figure."""
        return self._core().capture_budget

    @capture_budget.setter
    def capture_budget(self, nbytes):
        self._core().capture_budget = nbytes

    def prefill(self, ids, capture=None, logits="last", sampler=None, attn_rows=None, patch=None,
                capture_device="cpu") -> Trace:
        """Run ids at positions position .. position + n - 1 and advance the position.

        logits: "last" (one row, default), "all" (a row per token) or None (none handed back;
        without a sampler no lm_head either: for the early chunks of a long prompt).
        capture: glob pattern(s) of capture names.
        sampler: a qwencuda.Sampler that draws the next token from the last position's logits
        on the session's device (Trace.token): the same chain and RNG as sampler.sample(row),
        so the sampler's state advances alike; accept the token yourself (sampler.accept). With
        logits=None nothing but that token comes back from the device.
        attn_rows: the query rows (indices into ids; negative from the end) whose attn_scores /
        attn_probs are captured, e.g. -1 for the last token: those captures are then
        (n_head, len(attn_rows), n_kv), O(n) memory per row at any context length. None: all.
        patch: {capture name or glob: edit} changes tensors mid-forward (qwencuda.patching:
        an array, Replace / Add / Scale / ZeroHeads, or a function of the tensor); what comes
        after reads the patched values. No cost when None.
        capture_device: "cpu" (default): captures are NumPy arrays in host memory; "cuda": they
        stay in the GPU memory of a CUDA model as qwencuda.DeviceArray objects (DLPack and
        __cuda_array_interface__ for torch / CuPy, .numpy() for a host copy). ValueError on the CPU.
        Captures and logits that would take more host memory than capture_budget (device captures:
        more GPU memory) raise MemoryError before anything is allocated or run."""
        s = self._core()
        a = _ids(ids)
        on_device = _capture_device(capture_device, self._model.device)
        pats = _patterns(capture, self._model.capture_names())
        core_sampler = None
        if sampler is not None:
            core_sampler = getattr(sampler, "_s", sampler)
            if not isinstance(core_sampler, _core.Sampler):
                raise TypeError(f"sampler must be a qwencuda.Sampler, not {type(sampler).__name__}")
        rows = _attn_rows(attn_rows, a.size)
        names, hook = patching.as_hook(patch, self._model.capture_names(), self._model.config.n_head)
        start, lg, am, tensors, token = s.eval(a, logits, pats, core_sampler, rows,
                                               None if names is None else (names, hook), on_device)
        n = a.size
        positions = np.arange(start, start + n, dtype=np.int32)
        logit_positions = None
        if lg is not None:
            logit_positions = positions if logits == "all" else positions[-1:]
        return Trace(tensors=tensors, logits=lg, argmax=am, ids=a.astype(np.int32),
                     positions=positions, logit_positions=logit_positions,
                     source=self._model.device.split(":")[0], token=token, kv_type=s.kv_type)

    def step(self, token, capture=None, logits="last", sampler=None, patch=None, capture_device="cpu") -> Trace:
        """Run one token; the Trace holds the logits of its position (logits="last") or not
        (None), and with a sampler the next token drawn on the device (see prefill). patch and
        capture_device: as in prefill (a patched step runs op by op, not as the recorded CUDA
        graph)."""
        if isinstance(token, (list, tuple, np.ndarray)) and np.size(token) != 1:
            raise ValueError("step() takes one token; use prefill() for several")
        if logits not in ("last", None):
            raise ValueError(f"step() logits must be 'last' or None, got {logits!r}")
        # prefill checks the id as forward does (a float is a TypeError, not truncated)
        return self.prefill(np.asarray(token).reshape(1), capture=capture, logits=logits,
                            sampler=sampler, patch=patch, capture_device=capture_device)

    def reset(self):
        """Empty the cache (position 0)."""
        self._core().reset()

    def rewind(self, n):
        """Forget the last n tokens (0 <= n <= position)."""
        self._core().rewind(n)   # an int (the core refuses 1.7 rather than rewinding 1)

    def close(self):
        if self._s is not None:
            self._s.close()
            self._s = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self.closed:
            return "<qwencuda.Session closed>"
        return (f"<qwencuda.Session position={self.position} max_context={self.max_context} "
                f"kv_type={self.kv_type}>")


class Model:
    """A Qwen2 / Qwen2.5 GGUF model on a device.

    path None: QWENCUDA_MODEL, then the default model (qwencuda.default_model).
    device: "auto" (cuda when built and present, else cpu), "cpu", "cuda" or "cuda:N".
    threads: CPU worker threads (None: every core).
    kv_type: the KV cache type of this model's sessions unless a session names its own: "f16"
    (None on CUDA) or "f32" (None on the CPU)."""

    def __init__(self, path=None, device="auto", threads=None, kv_type=None):
        if path is None:
            from .default_model import resolve_model_path

            path = resolve_model_path(None)
        path = os.fspath(path)
        device = _resolve_device(device)
        threads = 0 if threads is None else int(threads)
        if threads < 0:
            raise ValueError(f"threads must be >= 0 (0 or None: every core), got {threads}")
        self._m = None
        self._m = _core.Model(path, device, threads)
        self.path = path
        self.device = self._m.device
        self.kv_type = _kv_type(kv_type, self.device)
        self.config = Config(**self._m.config)
        self._names = capture_names(self.config.n_layer)
        self._tokenizer = None
        self._file = None

    def _core_model(self):
        if self._m is None or self._m.closed:
            raise ValueError("the model is closed")
        return self._m

    @property
    def closed(self) -> bool:
        return self._m is None or self._m.closed

    @property
    def tokenizer(self):
        """The file's tokenizer (qwencuda.Tokenizer), loaded on first use."""
        if self._tokenizer is None:
            from .tokenizer import Tokenizer

            self._tokenizer = Tokenizer(self.path)
        return self._tokenizer

    @property
    def file(self):
        """The GGUF file (qwencuda.GGUFFile), opened on first use."""
        if self._file is None:
            from .gguf import GGUFFile

            self._file = GGUFFile(self.path)
        return self._file

    def tensor_types(self) -> dict:
        """The stored type of every matrix the engine reads, e.g. {"blk.0.attn_q.weight": "Q4_K"}."""
        return self._core_model().tensor_types()

    def capture_names(self) -> list:
        """Every capture name, in forward order."""
        return list(self._names)

    def session(self, max_context=None, kv_type=None, prefill_chunk=None) -> Session:
        """A KV cache of max_context positions (default min(4096, the training context)).

        kv_type: "f16" (half the memory, tensor-core flash attention on CUDA) or "f32" (on CUDA
        the exact fp32 attention); None: the model's kv_type. prefill_chunk: most tokens per
        forward pass (None: 4096)."""
        self._core_model()
        if max_context is None:
            n_ctx = self.config.n_ctx_train
            max_context = min(DEFAULT_MAX_CONTEXT, n_ctx) if n_ctx > 0 else DEFAULT_MAX_CONTEXT
        if isinstance(max_context, bool) or int(max_context) != max_context or max_context < 1:
            raise ValueError(f"max_context must be an int >= 1, got {max_context!r}")
        return Session(self, int(max_context), kv_type=kv_type, prefill_chunk=prefill_chunk)

    def forward(self, ids, capture=None, logits="all", kv_type=None, attn_rows=None, patch=None,
                capture_device="cpu") -> Trace:
        """One pass over ids from position 0 (a fresh KV cache) -> Trace. kv_type, attn_rows,
        patch and capture_device as in session() and Session.prefill()."""
        a = _ids(ids)
        _capture_device(capture_device, self.device)   # before the session's KV cache is made
        with self.session(max_context=a.size, kv_type=kv_type) as s:
            return s.prefill(a, capture=capture, logits=logits, attn_rows=attn_rows, patch=patch,
                             capture_device=capture_device)

    def generate(self, *args, **kwargs):
        """Generate text; see qwencuda.generation.generate."""
        from .generation import generate

        self._core_model()
        return generate(self, *args, **kwargs)

    def chat(self, *args, **kwargs):
        """Answer a conversation; see qwencuda.chat.chat."""
        from .chat import chat

        self._core_model()
        return chat(self, *args, **kwargs)

    def close(self):
        """Free the weights and every session (their use raises ValueError afterwards)."""
        if self._m is not None:
            self._m.close()
        if self._file is not None and hasattr(self._file, "close"):
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        c = self.config
        state = " closed" if self.closed else ""
        return (f"<qwencuda.Model{state} {os.path.basename(self.path)} on {self.device}: "
                f"{c.n_layer} layers, dim {c.dim}, {c.n_head}/{c.n_head_kv} heads, "
                f"vocab {c.n_vocab}{', tied' if c.tied else ''}>")
