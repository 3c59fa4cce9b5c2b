"""Fetch pinned tokenizer test data into a cache directory.

    python tests/fetch_testdata.py .cache/testdata

llama.cpp's tokenizer test vectors (`models/ggml-vocab-*.gguf` with `.inp` / `.out`) ship in
the sdist of the pinned `llama-cpp-python` package. We `pip download` that sdist (no deps, no
wheels) into <dest>/sdist/, extract only the vocabulary files into <dest>/, and skip all of it
when the files are already there. The sdist itself is a cache artifact, never committed.
"""
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
MEMBER_DIR = "vendor/llama.cpp/models/"
MEMBER_PREFIX = "ggml-vocab-"
# The vocabularies the tests require; if these are present the data is complete.
REQUIRED = ("ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf", "ggml-vocab-qwen2.gguf")


def is_complete(dest: Path) -> bool:
    return all((dest / name).is_file() for name in REQUIRED) and (dest / "VERSION").is_file()


def download_sdist(sdist_dir: Path) -> Path:
    sdist_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(sdist_dir.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--no-binary", ":all:", "--dest", str(sdist_dir), f"{PACKAGE}=={VERSION}"]
        if subprocess.run(command).returncode != 0:
            raise SystemExit(f"`{' '.join(command[2:])}` failed: the package registry must be reachable")
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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} DEST_DIR", file=sys.stderr)
        return 2
    dest = Path(argv[1])
    dest.mkdir(parents=True, exist_ok=True)
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
