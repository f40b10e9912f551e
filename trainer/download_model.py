"""Init job of the GPU profiles: download MODEL_NAME at MODEL_REVISION once into the shared HF cache,
then check its chat template the way preflight does, before vLLM starts on it; and JUDGE_MODEL at JUDGE_MODEL_REVISION
when the stack serves a judge (the judge service's model: no tool-call template check, it is asked, not trained). On
the CPU profile it runs for a Hub judge alone (MODEL_NAME empty: the CPU policy is model-init's tiny model).

The only service that sees HF_TOKEN (a Compose secret at /run/secrets/hf_token); vLLM and the
trainer then load the model offline from the cache volume, at the same revision.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

SECRET = Path("/run/secrets/hf_token")
PROGRESS_EVERY_S = 10.0


def bytes_under(folder: Path) -> int:
    """What is on disk under a repo's cache folder (finished blobs and `.incomplete` ones being written)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink()) if folder.is_dir() else 0


def report_download(model: str, revision: str | None, token: str | None, stop: threading.Event) -> None:
    """A progress line every PROGRESS_EVERY_S while snapshot_download runs: bytes in the cache against the size the
    hub lists for the revision's files (no total, so no ETA, when the hub does not say)."""
    from huggingface_hub import HfApi
    from huggingface_hub.constants import HF_HUB_CACHE

    from trainer.core.progress import Progress

    try:
        info = HfApi().model_info(model, revision=revision, token=token, files_metadata=True)
        total = sum(s.size or 0 for s in info.siblings or []) or None
    except Exception:  # snapshot_download reports the real error
        total = None
    folder = Path(HF_HUB_CACHE) / f"models--{model.replace('/', '--')}"
    before = bytes_under(folder)  # a resumed download: count only what this run fetches against the rest
    progress = Progress(f"[model-download] {model}", total - before if total and total > before else total, "B",
                        every_s=PROGRESS_EVERY_S)
    while not stop.wait(PROGRESS_EVERY_S):
        progress.update(bytes_under(folder) - before)


def check_downloaded(path: str, model: str) -> list[str]:
    """The chat-template checks of trainer.run.preflight on the tokenizer just downloaded."""
    from transformers import AutoTokenizer

    from trainer.run.preflight import check_chat_template

    return check_chat_template(AutoTokenizer.from_pretrained(path), model)


def main() -> int:
    model = os.environ.get("MODEL_NAME", "")
    judge = os.environ.get("JUDGE_MODEL", "")
    if not model and not judge:
        print("error: MODEL_NAME is empty; set it in .env", file=sys.stderr)
        return 2
    try:
        token = SECRET.read_text().strip() if SECRET.exists() else ""
    except PermissionError:
        print("error: the HF token secret is not readable by this container's user: on the host, "
              "`chmod 644` the file named by HF_TOKEN_FILE and `chmod 700` its directory (`make doctor` checks it)",
              file=sys.stderr)
        return 2
    if model:
        code = fetch(model, os.environ.get("MODEL_REVISION") or None, token, trained=True)
        if code:
            return code
    return fetch(judge, os.environ.get("JUDGE_MODEL_REVISION") or None, token, trained=False) if judge else 0


def fetch(model: str, revision: str | None, token: str, trained: bool) -> int:
    """One model at its revision into the cache: the policy (`trained`: its chat template checked as preflight does)
    or the judge."""
    from contract import stages

    name_var, revision_var = ("MODEL_NAME", "MODEL_REVISION") if trained else ("JUDGE_MODEL", "JUDGE_MODEL_REVISION")
    if Path(model).exists() or model.startswith("/"):
        print(f"[model-download] {model} is a local path; nothing to download")
        return 0
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    start = time.monotonic()
    stop = threading.Event()
    threading.Thread(target=report_download, args=(model, revision, token or None, stop), daemon=True).start()
    try:
        path = snapshot_download(model, revision=revision, token=token or None)
    except RevisionNotFoundError:
        print(f"error: {model!r} has no revision {revision!r}; set {revision_var} in .env to a commit of that model "
              "(its hub page, \"Files and versions\" > history), or empty for main", file=sys.stderr)
        return 2
    except (GatedRepoError, RepositoryNotFoundError) as e:
        print(f"error: cannot download {model!r}: {type(e).__name__}. Check {name_var} in .env; for a gated "
              f"model put a token in the file named by HF_TOKEN_FILE (default .secrets/hf_token).", file=sys.stderr)
        return 2
    finally:
        stop.set()
    at = f"revision {revision}" if revision else f"revision main (unpinned: set {revision_var} in .env)"
    if not trained:  # the judge: served as it is, asked rather than trained
        print(f"[model-download] judge {model} ({at}) ready at {path}")
        return 0
    stages.mark("model_download", time.monotonic() - start, f"{model} at {at}")
    problems = check_downloaded(path, model)
    if problems:
        for problem in problems:
            print(f"error: {problem} (downloaded {at})", file=sys.stderr)
        print("error: vLLM is not started on a model TRL cannot train tool calls with", file=sys.stderr)
        return 2
    print(f"[model-download] {model} ({at}) ready at {path}; chat template: TRL can parse and train tool calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
