"""Init job of the GPU profiles: download MODEL_NAME once into the shared HF cache.

The only service that sees HF_TOKEN (a Compose secret at /run/secrets/hf_token); vLLM and the
trainer then load the model offline from the cache volume.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SECRET = Path("/run/secrets/hf_token")


def main() -> int:
    model = os.environ.get("MODEL_NAME", "")
    if not model:
        print("error: MODEL_NAME is empty; set it in .env", file=sys.stderr)
        return 2
    if Path(model).exists():
        print(f"[model-download] {model} is a local path; nothing to download")
        return 0
    try:
        token = SECRET.read_text().strip() if SECRET.exists() else ""
    except PermissionError:
        print("error: the HF token secret is not readable by this container's user: on the host, "
              "`chmod 644` the file named by HF_TOKEN_FILE and `chmod 700` its directory (`make doctor` checks it)",
              file=sys.stderr)
        return 2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        path = snapshot_download(model, token=token or None)
    except (GatedRepoError, RepositoryNotFoundError) as e:
        print(f"error: cannot download {model!r}: {type(e).__name__}. Check MODEL_NAME in .env; for a gated "
              f"model put a token in the file named by HF_TOKEN_FILE (default .secrets/hf_token).", file=sys.stderr)
        return 2
    print(f"[model-download] {model} ready at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
