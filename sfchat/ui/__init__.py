"""The Textual chat UI of sfchat (never imports torch, ``sfchat.model``, ``sfchat.engine`` or ``sfchat.node``).

``SfchatApp(runtime, history, params, title)`` is the app; ``run_tui`` runs it in the terminal.
"""

from sfchat.ui.app import SfchatApp, run_tui
from sfchat.ui.runtime import Runtime, RuntimeEvent

__all__ = ["SfchatApp", "Runtime", "RuntimeEvent", "run_tui"]
