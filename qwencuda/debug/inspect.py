"""`python -m qwencuda inspect FILE`: what a GGUF file holds, without running it.

Prints the architecture, its hyperparameters (the `<arch>.*` keys), the other metadata, a
tokenizer summary (model, vocabulary size, merges, token types, special tokens), the tensor
table (name, shape in NumPy order, type, size) and totals (count, bytes, count per type).

    from qwencuda.debug.inspect import describe
    print(describe("model.gguf"))
"""
import argparse
import math
import sys
from collections import Counter

from ..gguf import GGUFFile

__all__ = ["describe", "main"]

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_TYPES = {1: "normal", 2: "unknown", 3: "control", 4: "user-defined", 5: "unused", 6: "byte"}
_MAX_VALUE_CHARS = 60


def human_bytes(n):
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def _short(value):
    """A metadata value on one line: long strings and arrays summarised."""
    if isinstance(value, list):
        head = ", ".join(_short(v) for v in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"[{head}{more}] ({len(value)} items)"
    if isinstance(value, str):
        text = repr(value)
        if len(text) > _MAX_VALUE_CHARS:
            text = repr(value[:_MAX_VALUE_CHARS - 20]) + f"... ({len(value)} chars)"
        return text
    return repr(value)


def _token(tokens, i):
    if isinstance(i, int) and isinstance(tokens, list) and 0 <= i < len(tokens):
        return f"{i} {tokens[i]!r}"
    return f"{i} (not in the vocabulary)" if isinstance(i, int) else "-"


def _tokenizer_lines(md):
    if not any(k.startswith("tokenizer.") for k in md):
        return ["  (no tokenizer.* keys)"]
    tokens = md.get("tokenizer.ggml.tokens")
    merges = md.get("tokenizer.ggml.merges")
    types = md.get("tokenizer.ggml.token_type")
    lines = [
        f"  model           {md.get('tokenizer.ggml.model', '-')}"
        f" (pre-tokenizer {md.get('tokenizer.ggml.pre', '-')})",
        f"  vocab size      {len(tokens) if isinstance(tokens, list) else '-'}",
        f"  merges          {len(merges) if isinstance(merges, list) else '-'}",
    ]
    if isinstance(types, list):
        counts = Counter(types)
        parts = [f"{TOKEN_TYPES[t]} {counts.get(t, 0)}" for t in (1, 3, 4, 5)]
        parts += [f"{TOKEN_TYPES.get(t, f'type {t}')} {n}" for t, n in sorted(counts.items())
                  if t not in (1, 3, 4, 5)]
        lines.append(f"  token types     {', '.join(parts)}")
    for label, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                       ("pad", "padding_token_id")):
        value = md.get(f"tokenizer.ggml.{key}")
        lines.append(f"  {label:<15} {_token(tokens, value) if value is not None else '-'}")
    for key in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{key}" in md:
            lines.append(f"  {key:<15} {md[f'tokenizer.ggml.{key}']}")
    template = md.get("tokenizer.chat_template")
    lines.append(f"  chat template   {f'{len(template)} chars' if isinstance(template, str) else 'none'}")
    return lines


def _tensor_lines(tensors):
    rows = [(t.name, "x".join(map(str, t.shape)) or "()", t.type, human_bytes(t.nbytes))
            for t in tensors.values()]
    head = ("name", "shape", "type", "size")
    widths = [max([len(head[i])] + [len(r[i]) for r in rows]) for i in range(4)]

    def fmt(r):
        return (f"  {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  "
                f"{r[3]:>{widths[3]}}").rstrip()

    return [fmt(head)] + [fmt(r) for r in rows]


def describe(path):
    """A multi-line text report of the GGUF file at `path` (raises GGUFError / OSError)."""
    with GGUFFile(path) as f:
        md, mtypes, tensors = f.metadata, f.metadata_types, f.tensors
        out = [f"file: {f.path}",
               f"GGUF v{f.version}, {len(md)} metadata keys, {len(tensors)} tensors, "
               f"alignment {f.alignment}, data at offset {f.data_offset}, "
               f"{human_bytes(f.size)} ({f.size} bytes)"]
        arch = md.get("general.architecture")
        out.append(f"architecture: {arch if arch is not None else '(general.architecture missing)'}")

        out.append("")
        out.append("hyperparameters:")
        prefix = f"{arch}." if isinstance(arch, str) else None
        hyper = [k for k in md if prefix and k.startswith(prefix)]
        for k in hyper:
            out.append(f"  {k[len(prefix):]:<38} {_short(md[k])}")
        if not hyper:
            out.append("  (none)")

        out.append("")
        out.append("other metadata:")
        other = [k for k in md if k not in hyper and not k.startswith("tokenizer.")]
        for k in other:
            out.append(f"  {k:<38} {mtypes[k]:<14} {_short(md[k])}")
        if not other:
            out.append("  (none)")

        out.append("")
        out.append("tokenizer:")
        out.extend(_tokenizer_lines(md))

        out.append("")
        out.append("tensors (shape in NumPy order: GGUF ne reversed):")
        if tensors:
            out.extend(_tensor_lines(tensors))
        else:
            out.append("  (none)")

        total = sum(t.nbytes for t in tensors.values())
        per_type = Counter(t.type for t in tensors.values())
        bytes_per_type = Counter()
        for t in tensors.values():
            bytes_per_type[t.type] += t.nbytes
        out.append("")
        elements = sum(math.prod(t.shape) for t in tensors.values())
        out.append(f"totals: {len(tensors)} tensors, {elements} elements, {total} bytes "
                   f"({human_bytes(total)})")
        for type_name, n in sorted(per_type.items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"  {type_name:<8} {n:>5} tensors  {human_bytes(bytes_per_type[type_name]):>12}")
    return "\n".join(out) + "\n"


def main(argv=None):
    """`inspect FILE`: print describe(FILE). Returns 0, 1 on an unreadable file, 2 on usage."""
    parser = argparse.ArgumentParser(prog="python -m qwencuda inspect",
                                     description="Metadata, tokenizer and tensor table of a GGUF file.")
    parser.add_argument("file", help="path to a .gguf file")
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    from .. import GGUFError

    try:
        text = describe(args.file)
    except (GGUFError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `... inspect FILE | head`
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
