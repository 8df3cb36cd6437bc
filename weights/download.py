"""Fetch a checkpoint from the Hugging Face Hub, and turn a --checkpoint value into a local folder.

    python -m weights.download REPO_ID [--revision REV] [--dir DIR]

Only the files the engine reads are fetched (safetensors weights, the JSON configs, the tokenizer,
the chat template), never other weight formats. Without --dir they go to the hub cache, where
`resolve_checkpoint("org/name")` finds them later, offline.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from errors import UserError, run_command

# Exactly what weights.loader and weights.tokenizer open. Not "*.safetensors": some repos also carry
# a second copy of the weights (e.g. Mistral's consolidated.safetensors), which would double the download.
ALLOW_PATTERNS = [
    "model*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_PROBE_TIMEOUT_S = 5.0


def download(repo_id: str, revision: str | None = None, local_dir: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """Fetch the engine's files of `repo_id` (into local_dir, or the hub cache) and return the folder."""
    _check_online(repo_id)
    try:
        folder = snapshot_download(
            repo_id, revision=revision, local_dir=local_dir, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS, etag_timeout=_PROBE_TIMEOUT_S
        )
    except GatedRepoError as e:
        raise UserError(f"{repo_id} is gated: accept its license on the hub, then log in with `hf auth login` ({_first_line(e)})") from e
    except RepositoryNotFoundError as e:
        raise UserError(f"no hub repository {repo_id!r} (or it is private and you are not logged in: `hf auth login`)") from e
    except RevisionNotFoundError as e:
        raise UserError(f"{repo_id} has no revision {revision!r}; give a branch, tag or commit that exists") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise UserError(_unreachable(repo_id, _first_line(e))) from e
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UserError(f"{repo_id} has no config.json: it is not a Hugging Face model repository the engine can run")
    if not any(folder.glob("model*.safetensors")):
        raise UserError(f"{repo_id} has no safetensors weights (model*.safetensors); the engine reads no other format")
    return folder


def resolve_checkpoint(spec: str, *, cache_dir: str | Path | None = None) -> Path:
    """A --checkpoint value as a local folder: the folder itself, or a hub repo id's snapshot.

    A repo id that is not in the hub cache is downloaded; offline, or with the hub unreachable,
    this fails at once instead of waiting on retries.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        hint = " (a GGUF file: import it first with `python -m weights.gguf FILE OUT_DIR`)" if path.suffix == ".gguf" else ""
        raise UserError(f"{spec} is a file, not a checkpoint folder{hint}")
    if not _REPO_ID.fullmatch(spec) or "--" in spec or ".." in spec:
        raise UserError(f"no such folder: {spec}; pass a checkpoint folder (config.json, *.safetensors, tokenizer.json) or a hub repo id like org/name")
    try:  # the hub cache first: no network involved
        folder = Path(snapshot_download(spec, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS, local_files_only=True))
        if (folder / "config.json").is_file():
            return folder
    except LocalEntryNotFoundError:
        pass
    return download(spec, cache_dir=cache_dir)


def _check_online(repo_id: str) -> None:
    """Fail now, with the way out, when the hub cannot be reached (the hub client itself has no connect timeout)."""
    if constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE"):
        raise UserError(_unreachable(repo_id, "HF_HUB_OFFLINE is set"))
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # through a proxy a direct probe says nothing; the hub client goes through it
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    reached: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
            reached.append(True)
        except OSError:
            reached.append(False)

    # In a thread, because name resolution has no timeout of its own.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(_PROBE_TIMEOUT_S)
    if not reached or not reached[0]:
        raise UserError(_unreachable(repo_id, f"cannot connect to {host}"))


def _unreachable(repo_id: str, reason: str) -> str:
    return (
        f"cannot fetch {repo_id}: the hub is unreachable ({reason}) and the repo is not in the local hub cache. "
        f"On a machine with internet run `python -m weights.download {repo_id} --dir FOLDER`, copy FOLDER here "
        "and pass it as the checkpoint (or pass any local checkpoint folder)"
    )


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weights.download", description="Fetch a checkpoint's safetensors, configs and tokenizer from the Hugging Face Hub.")
    p.add_argument("repo_id", help="hub repository, e.g. Qwen/Qwen3-0.6B")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument("--dir", type=Path, help="download into this folder instead of the hub cache")
    args = p.parse_args(argv)
    return run_command(lambda: print(download(args.repo_id, args.revision, args.dir)))


if __name__ == "__main__":
    sys.exit(main())
