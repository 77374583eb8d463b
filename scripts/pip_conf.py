"""Turns ``pip config list`` (on stdin) into a pip.conf at ``argv[1]`` for
an image build, and prints the ``buildah -v`` mounts it needs: every local
path the configuration names (file:// indexes, wheel directories, the CA
bundle; a local index whole, as its pages link outside ``simple/``),
read-only, and pip's cache, so the build reuses its downloads."""
import shlex
import subprocess
import sys
from pathlib import Path

# Settings that only make sense on this machine's own pip.
SKIP = {"disable-pip-version-check", "cache-dir"}


def main() -> None:
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in sys.stdin:
        key, sep, value = line.strip().partition("=")
        if not sep:
            continue
        scope, _, name = key.rpartition(".")
        if name not in SKIP:
            # pip's own precedence: the environment over its files.
            into = env if scope == ":env:" else files
            into[name] = " ".join(shlex.split(value))
    settings = {**files, **env}
    conf = Path(sys.argv[1])
    conf.write_text("[global]\n" + "".join(
        f"{name} = {value}\n" for name, value in sorted(settings.items())))
    mounts = []
    for value in settings.values():
        for word in value.split():
            path = word.removeprefix("file://").rstrip("/")
            if path.endswith("/simple"):  # its pages link to ../../files
                path = path.rpartition("/")[0]
            if path.startswith("/") and Path(path).exists() and \
                    path not in mounts:
                mounts.append(path)
    for path in mounts:
        print(f"{path}:{path}:ro")
    cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"],
                           capture_output=True, text=True,
                           check=True).stdout.strip()
    if cache:
        Path(cache).mkdir(parents=True, exist_ok=True)
        print(f"{cache}:/root/.cache/pip")


if __name__ == "__main__":
    main()
