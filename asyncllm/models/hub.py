"""Hugging Face hub ids (ORG/NAME) as model directories: the repository's safetensors weights, config
and tokenizer files downloaded by huggingface_hub into its cache (HF_HOME, HF_HUB_CACHE; a token from
HF_TOKEN), and the cached snapshot used as it is when the hub cannot be reached or HF_HUB_OFFLINE=1.

Pickle weights (.bin, .pt, ...) and code (*.py: remote code) are never downloaded; a repository
without safetensors weights is refused before anything is fetched.
"""
from __future__ import annotations

import glob
import os
import sys

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from asyncllm.config import config_error
from asyncllm.models.checkpoint import PICKLE_SUFFIXES

# the top-level files a checkpoint directory needs: weights, configs, tokenizers, chat templates
_DOWNLOADED_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".tiktoken", ".jinja")


def download_model(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot directory of hub repository repo_id at revision (None: main), downloaded
    where it is not cached (progress shown), or the cached one where the hub cannot be reached."""
    if constants.HF_HUB_OFFLINE:
        return _cached_snapshot(repo_id, revision, "HF_HUB_OFFLINE is set")
    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except RevisionNotFoundError:
        raise config_error("revision", f"the hub repository {repo_id!r} has no revision {revision!r}") from None
    except GatedRepoError:
        raise config_error("model", f"the hub repository {repo_id!r} is gated: accept its terms on "
                           "huggingface.co and set HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise config_error("model", f"{repo_id!r} is not a local path, and the Hugging Face hub has no model "
                           f"{repo_id!r} (a private one needs HF_TOKEN)") from None
    except Exception as e:  # noqa: BLE001 - no network: requests', httpx's and the hub's own errors, by version
        return _cached_snapshot(repo_id, revision, f"the hub cannot be reached: {type(e).__name__}: {e}")
    files = {s.rfilename: s.size or 0 for s in info.siblings or () if "/" not in s.rfilename}
    _check_safetensors(repo_id, list(files))
    wanted = sorted(name for name in files if name.endswith(_DOWNLOADED_SUFFIXES))
    size = sum(files[name] for name in wanted)
    print(f"asyncllm: {repo_id} ({revision or 'main'}, commit {(info.sha or '?')[:12]}): {len(wanted)} files, "
          f"{size / 2**30:.2f} GiB, into {constants.HF_HUB_CACHE} (cached files are not downloaded again)",
          file=sys.stderr, flush=True)
    try:
        # by the revision's name, not the listed commit: the cache then maps the name to the commit
        # (refs/main), which is what finds the snapshot offline later
        path = snapshot_download(repo_id, revision=revision, allow_patterns=wanted)
    except Exception as e:  # noqa: BLE001 - a download cut short fails in the HTTP library of the version
        raise OSError(f"downloading {repo_id!r} from the Hugging Face hub failed: {type(e).__name__}: {e}") from e
    _check_safetensors(repo_id, os.listdir(path))
    return path


def _cached_snapshot(repo_id: str, revision: str | None, why: str) -> str:
    try:
        path = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError, IncompleteSnapshotError, by version
        raise OSError(f"no network ({why}) and {repo_id!r}{f' revision {revision!r}' if revision else ''} is not in "
                      f"the Hugging Face cache {constants.HF_HUB_CACHE} ({type(e).__name__}): pass a local directory, "
                      f"or pre-download it where there is network with `hf download {repo_id}"
                      f"{f' --revision {revision}' if revision else ''}` into the same HF_HOME") from None
    _check_safetensors(repo_id, [os.path.basename(p) for p in glob.glob(os.path.join(path, "*"))])
    return path


def _check_safetensors(repo_id: str, files: list[str]) -> None:
    if any(name.endswith(".safetensors") for name in files):
        return
    pickles = sorted(name for name in files if name.endswith(PICKLE_SUFFIXES))
    held = f"it holds {', '.join(pickles)}: pickle checkpoints are refused, since loading them can run arbitrary " \
           "code" if pickles else "it holds no weights asyncllm can read"
    raise config_error("model", f"the hub repository {repo_id!r} has no .safetensors weights ({held}); pick a "
                       "repository with safetensors weights, or convert these and pass the local directory")
