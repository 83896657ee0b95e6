"""Files the library downloads once (HellaSwag, the CORE bundle, tiny Shakespeare): fetched to a
local path, checked against a known sha256, written whole (a temporary file renamed over it).
Every caller also takes a local copy, so nothing needs the network."""

import os

from configurator import UserError


def fetch(url, sha256, path, local="--input PATH"):
    """Download url to path (once), checking its sha256 when one is known; a failure is one line
    that says to pass a local copy (the `local` flag)."""
    if os.path.exists(path):
        return path
    import hashlib
    import urllib.request

    print(f"downloading {url} -> {path}")
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            raw = r.read()
    except OSError as e:
        raise UserError(f"cannot download {url} ({e}); pass a local copy with {local}")
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise UserError(
            f"the file downloaded from {url} is not the expected one (sha256 differs); pass a local copy with {local}"
        )
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # each process its own (ranks may download at once): the last rename wins, whole
    with open(tmp, "wb") as f:
        f.write(raw)
    os.replace(tmp, path)
    return path
