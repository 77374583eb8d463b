"""scripts/pip_conf.py: the image build's pip configuration, made from
``pip config list``, and the read-only mounts it needs."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "pip_conf.py"


def run(listing: str, conf: Path) -> list[str]:
    result = subprocess.run([sys.executable, str(SCRIPT), str(conf)],
                            input=listing, capture_output=True, text=True,
                            timeout=60, check=True)
    return result.stdout.splitlines()


def test_pip_conf_and_mounts(tmp_path):
    cert = tmp_path / "ca.crt"
    cert.write_text("x")
    index = tmp_path / "pypi" / "simple"
    index.mkdir(parents=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    listing = "\n".join([
        f":env:.cert='{cert}'",
        ":env:.disable-pip-version-check='1'",
        ":env:.timeout='90'",
        f":env:.find-links='{wheels}'",
        f"global.cert='{cert}'",
        f"global.extra-index-url='file://{index} file:///nowhere/simple'",
        "global.timeout='60'",
    ]) + "\n"
    conf = tmp_path / "pip.conf"
    mounts = run(listing, conf)
    # One line per setting (the environment's and the file's cert are one;
    # the environment wins, as in pip), and nothing that only this
    # machine's pip wants.
    assert conf.read_text() == (
        "[global]\n"
        f"cert = {cert}\n"
        f"extra-index-url = file://{index} file:///nowhere/simple\n"
        f"find-links = {wheels}\n"
        "timeout = 90\n")
    # Paths that exist, read-only, each once; a local index whole (its
    # pages link to ../../files); then pip's cache, writable.
    assert sorted(mounts[:3]) == sorted([
        f"{cert}:{cert}:ro", f"{index.parent}:{index.parent}:ro",
        f"{wheels}:{wheels}:ro"])
    assert len(mounts) == 4 and mounts[3].endswith(":/root/.cache/pip")
