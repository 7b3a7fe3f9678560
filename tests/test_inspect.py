"""`python -m qwencuda inspect FILE` (qwencuda/debug/inspect.py): the report on a synthetic file whose
contents we choose, and on the real model, checked against the gguf package's reader."""
import os
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

import qwencuda  # noqa: E402
from qwencuda.debug.inspect import describe, main  # noqa: E402

TOKENS = ["a", "b", "ab", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>", "[PAD0]", "[PAD1]"]
TOKEN_TYPES = [1, 1, 1, 3, 3, 3, 4, 5, 5]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("inspect") / "syn.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(3)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_rope_freq_base(1e6)
    w.add_name("synthetic for inspect")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(3)
    w.add_eos_token_id(5)
    w.add_pad_token_id(3)
    w.add_chat_template("{{ messages }}")
    w.add_tensor("token_embd.weight", gguf_quantize(rng.standard_normal((9, 64)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)                                      # 9 x 2 x 34 = 612 bytes
    w.add_tensor("blk.0.attn_q.weight", gguf_quantize(rng.standard_normal((64, 64)).astype(np.float32), T.Q4_0),
                 raw_dtype=T.Q4_0)                                      # 64 x 2 x 18 = 2304 bytes
    w.add_tensor("blk.0.attn_q.bias", rng.standard_normal(64).astype(np.float32))    # 256 bytes
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))   # 256 bytes
    w.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((8, 64)).astype(np.float16))  # 1024 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def section(text, title):
    """Lines of one section of the report (from its title to the next blank line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    out = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        out.append(line)
    return out


def test_describe_synthetic(synthetic):
    text = describe(synthetic)
    assert "GGUF v3, " in text and "architecture: qwen2" in text
    hyper = section(text, "hyperparameters:")
    assert re.search(r"^\s+block_count\s+3$", "\n".join(hyper), re.M)
    assert re.search(r"^\s+rope.freq_base\s+1000000.0$", "\n".join(hyper), re.M)
    assert any("general.name" in line and "synthetic for inspect" in line for line in section(text, "other metadata:"))

    tok = "\n".join(section(text, "tokenizer:"))
    assert re.search(r"model\s+gpt2 \(pre-tokenizer qwen2\)", tok)
    assert re.search(r"vocab size\s+9$", tok, re.M)
    assert re.search(r"merges\s+1$", tok, re.M)
    assert "normal 3, control 3, user-defined 1, unused 2" in tok
    assert re.search(r"bos\s+3 '<\|endoftext\|>'", tok)
    assert re.search(r"eos\s+5 '<\|im_end\|>'", tok)
    assert re.search(r"pad\s+3 '<\|endoftext\|>'", tok)
    assert re.search(r"chat template\s+14 chars", tok)

    table = section(text, "tensors")
    assert table[0].split() == ["name", "shape", "type", "size"]
    rows = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert list(rows) == ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_q.bias",
                          "output_norm.weight", "blk.0.ffn_up.weight"]
    assert rows["token_embd.weight"] == ["9x64", "Q8_0", "612", "B"]
    assert rows["blk.0.attn_q.weight"] == ["64x64", "Q4_0", "2.25", "KiB"]
    assert rows["blk.0.attn_q.bias"] == ["64", "F32", "256", "B"]
    assert rows["blk.0.ffn_up.weight"] == ["8x64", "F16", "1.00", "KiB"]

    total = 612 + 2304 + 256 + 256 + 1024
    elements = 9 * 64 + 64 * 64 + 64 + 64 + 8 * 64
    assert f"totals: 5 tensors, {elements} elements, {total} bytes" in text
    per_type = {line.split()[0]: int(line.split()[1]) for line in section(text, "totals:")}
    assert per_type == {"F32": 2, "Q8_0": 1, "Q4_0": 1, "F16": 1}


def test_describe_file_without_tokenizer_or_tensors(tmp_path):
    path = tmp_path / "empty.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    text = describe(path)
    assert "architecture: llama" in text and "(no tokenizer.* keys)" in text
    assert "totals: 0 tensors, 0 elements, 0 bytes" in text


def test_main_exit_codes(synthetic, tmp_path, capsys):
    assert main([synthetic]) == 0
    out = capsys.readouterr().out
    assert out == describe(synthetic)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(3))
    assert main([str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.gguf" in err and "runs past end of file" in err
    assert main([str(tmp_path / "missing.gguf")]) == 1
    assert "No such file" in capsys.readouterr().err
    assert main([]) == 2


def _env():
    env = dict(os.environ)
    parent = os.path.dirname(os.path.dirname(os.path.abspath(qwencuda.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def test_python_dash_m(synthetic, tmp_path):
    r = subprocess.run([sys.executable, "-m", "qwencuda.debug.inspect", synthetic], capture_output=True,
                       text=True, env=_env(), cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "totals: 5 tensors" in r.stdout


def test_cli_dispatch(synthetic, capsys):
    cli = pytest.importorskip("qwencuda.cli")
    assert cli.main(["inspect", synthetic]) == 0
    assert "totals: 5 tensors" in capsys.readouterr().out


@pytest.mark.realmodel
def test_describe_real_model(real_model_path):
    """Against the file's known contents (test_gguf.py checks the reader itself against the gguf
    package's GGUFReader, which takes ~10 s on this file)."""
    text = describe(real_model_path)
    with qwencuda.GGUFFile(real_model_path) as f:
        # bytes from shapes and the gguf package's block sizes, not from the reader's nbytes
        total = sum(int(np.prod(t.shape)) // gguf.GGML_QUANT_SIZES[T[t.type]][0] *
                    gguf.GGML_QUANT_SIZES[T[t.type]][1] for t in f.tensors.values())
        token_types = Counter(f.metadata["tokenizer.ggml.token_type"])
    assert f"totals: 291 tensors, " in text and f" {total} bytes" in text
    per_type = {line.split()[0]: int(line.split()[1]) for line in section(text, "totals:")}
    assert per_type == {"Q5_0": 133, "F32": 121, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}
    table = section(text, "tensors")
    assert len(table) == 1 + 291
    rows = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert rows["token_embd.weight"][:2] == ["151936x896", "Q5_0"]
    assert rows["output.weight"][:2] == ["151936x896", "Q8_0"]
    assert rows["blk.0.ffn_down.weight"][:2] == ["896x4864", "Q6_K"]
    assert rows["blk.23.attn_k.bias"][:2] == ["128", "F32"]
    tok = "\n".join(section(text, "tokenizer:"))
    assert sum(token_types.values()) == 151936
    assert (f"normal {token_types[1]}, control {token_types[3]}, user-defined {token_types[4]}, "
            f"unused {token_types[5]}") in tok
    assert re.search(r"vocab size\s+151936$", tok, re.M)
    assert re.search(r"merges\s+151387$", tok, re.M)
    assert re.search(r"bos\s+151643 '<\|endoftext\|>'", tok)
    assert re.search(r"eos\s+151645 '<\|im_end\|>'", tok)
    hyper = "\n".join(section(text, "hyperparameters:"))
    assert re.search(r"block_count\s+24$", hyper, re.M)
    assert re.search(r"attention.head_count_kv\s+2$", hyper, re.M)
