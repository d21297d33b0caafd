"""The Textual chat UI of sfchat (never imports torch or ``sfchat.runtime``).

``SfchatApp(runtime, history, params, title)`` is the app; ``run_tui`` runs it in the terminal.
"""

from sfchat.ui.app import Runtime, RuntimeEvent, SfchatApp, run_tui

__all__ = ["SfchatApp", "Runtime", "RuntimeEvent", "run_tui"]
