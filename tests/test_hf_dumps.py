"""docs/debugging.md's HF transformers dump script, run as written (issue 14 item 9).

A synthetic Qwen2 model is exported to HF format (save_pretrained of a Qwen2ForCausalLM holding
the GGUF file's weights), the script block of docs/debugging.md runs on it in a subprocess, and
`python -m qwencuda compare hf.npz correct.npz --map hf` must find no divergence between its
dumps and the reference engine's capture of the same ids, over the tensors the name map knows
(hidden states, q/k/v, attention probabilities, the inputs of o_proj and down_proj, logits).
A reference run with a known fault must diverge, so the comparison can fail. Skipped without
torch and transformers (they exist on the GPU machine, not on the CI box).
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import qwencuda as qc

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "debugging.md")
IDS = [1, 17, 255, 3, 99, 42, 7, 300]


def _doc_script():
    """The python block that follows "A dump script" in docs/debugging.md."""
    text = open(DOC, encoding="utf-8").read()
    at = text.index("A dump script")
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, at)
    assert m, "no python block after 'A dump script' in docs/debugging.md"
    return m.group(1)


def _env():
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(qc.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(ref, hf_dir): the tiny-gqa7 f32 model as a RefModel and as an HF folder."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_reference import _hf_model   # the HF model with the GGUF weights (and its checks)

    d = tmp_path_factory.mktemp("hf")
    path = qc.testing.write_model(str(d / "m.gguf"), "tiny-gqa7", "f32")
    ref = qc.reference.load(path, progress=False)
    _, model = _hf_model(ref)
    model.save_pretrained(str(d / "hf"))
    return ref, str(d / "hf")


def _compare(cwd, *args):
    return subprocess.run([sys.executable, "-m", "qwencuda", "compare", *args], cwd=cwd,
                          capture_output=True, text=True, env=_env(), timeout=300)


def test_the_docs_dump_script_matches_the_reference(exported, tmp_path):
    ref, hf_dir = exported
    script = f"hf_dir = {hf_dir!r}\nids = {IDS!r}\n" + _doc_script()
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       env=_env(), timeout=600)
    assert r.returncode == 0, f"the dump script of docs/debugging.md failed:\n{r.stderr[-4000:]}"
    dumps = np.load(tmp_path / "hf.npz")
    n_layer = ref.config.n_layer
    for name in ("model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj.input",
                 "model.layers.0.self_attn.o_proj.input", "lm_head", f"hidden_states.{n_layer}",
                 f"attentions.{n_layer - 1}"):
        assert name in dumps.files, name
    assert "model" not in dumps.files          # the ModelOutput of the whole model is skipped

    qc.reference.forward(ref, IDS).save(str(tmp_path / "correct.npz"))
    c = _compare(tmp_path, "hf.npz", "correct.npz", "--map", "hf")
    assert c.returncode == 0, f"compare found a divergence (rc {c.returncode}):\n{c.stdout[-6000:]}\n{c.stderr[-2000:]}"
    ok = {ln.split()[0] for ln in c.stdout.splitlines() if ln.rstrip().endswith(" ok") or "  ok  " in ln}
    for want in ("embed", "blk.0.q", "blk.0.k", "blk.0.attn_probs", "blk.0.attn_out", "blk.1.ffn_act",
                 "blk.1.resid_out", "output_norm", "logits"):
        assert want in ok, f"{want} was not compared ok:\n{c.stdout[-6000:]}"

    # the same dumps against a reference with a known fault: compare must see it
    qc.reference.forward(ref, IDS, faults=("rope_base_1e4",)).save(str(tmp_path / "faulty.npz"))
    bad = _compare(tmp_path, "hf.npz", "faulty.npz", "--map", "hf")
    assert bad.returncode == 1, bad.stdout[-3000:]
