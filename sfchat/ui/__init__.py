"""The Textual chat UI of sfchat (never imports torch, ``sfchat.model``, ``sfchat.engine`` or ``sfchat.node``).

``SfchatApp(runtime, history, params, title)`` is the app; ``run_tui`` runs it in the terminal.
"""

from sfchat.ui.app import Runtime, RuntimeEvent, SfchatApp, run_tui

__all__ = ["SfchatApp", "Runtime", "RuntimeEvent", "run_tui"]
