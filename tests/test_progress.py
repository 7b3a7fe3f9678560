"""Progress bars of the long steps (issue 14 item 8): drawn on stderr when asked (or on a
terminal), quiet when piped, when progress=False, and under QWENCUDA_PROGRESS=0."""
import pytest

import qwencuda as qc
from qwencuda import progress
from engine_util import model_file

pytest.importorskip("gguf")


def test_enabled_follows_the_argument_the_terminal_and_the_switch(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("QWENCUDA_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", Tty())
    assert progress.enabled(None) and progress.enabled(True) and not progress.enabled(False)
    monkeypatch.setenv("QWENCUDA_PROGRESS", "0")
    assert not progress.enabled(None) and not progress.enabled(True)


def test_reference_load_draws_a_bar_only_when_asked(capsys, monkeypatch):
    monkeypatch.delenv("QWENCUDA_PROGRESS", raising=False)
    path = model_file()
    qc.reference.load(path)                       # stderr is captured: not a terminal
    assert "reference.load" not in capsys.readouterr().err
    qc.reference.load(path, progress=False)
    assert "reference.load" not in capsys.readouterr().err
    ref = qc.reference.load(path, progress=True)
    err = capsys.readouterr().err
    assert "reference.load: dequantize" in err and f"/{len(ref.weights)} " in err   # the total of the bar
    monkeypatch.setenv("QWENCUDA_PROGRESS", "0")
    qc.reference.load(path, progress=True)
    assert "reference.load" not in capsys.readouterr().err


def test_diagnose_counts_its_reference_runs(capsys, monkeypatch):
    monkeypatch.delenv("QWENCUDA_PROGRESS", raising=False)
    path = model_file()
    ids = [1, 2, 3, 4]
    ref = qc.reference.load(path, progress=False)
    dumps = qc.reference.forward(ref, ids, capture="*", logits="all", faults=("rope_base_1e4",))
    capsys.readouterr()
    d = qc.diagnose(dumps, ref, ids, progress=True)
    err = capsys.readouterr().err
    n = len(qc.reference.FAULTS)
    assert d.fault == "rope_base_1e4"
    assert "diagnose: reference runs" in err and f"/{n} " in err
    qc.diagnose(dumps, ref, ids)
    assert "diagnose" not in capsys.readouterr().err
