"""The debugging tools, built on the public API (Model, Trace) and the reference engine:

    compare    where two runs part (first divergence, per-tensor errors; dumps of any engine)
    diagnose   which known engine bug explains a set of dumps; localise: where yours goes wrong
    lens       the logit lens: every layer's residual stream through the final norm and lm_head
    inspect    a GGUF file's metadata and tensor table (python -m qwencuda inspect)
    namemaps   the tensor names of llama.cpp, HF transformers and other engines -> qwencuda's

The entry points are also qwencuda.compare, qwencuda.diagnose, qwencuda.localise,
qwencuda.logit_lens (imported lazily).
"""
