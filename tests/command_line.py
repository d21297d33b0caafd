"""How the tests run the command line: the repository's root and the environment of a child sfchat."""

from __future__ import annotations

import os
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent


def cli_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFCHAT_") or k == "SFCHAT_STATE_DIR"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", HF_HOME=str(home / "hf"),
               XDG_CONFIG_HOME=str(home / "config"), XDG_DATA_HOME=str(home / "data"),
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env
