"""sfchat: one language model split across two machines, with speculative decoding over a relay."""

__version__ = "0.1.0"


class UserError(Exception):
    """A problem the user can fix (bad flag, missing model, ...): shown as one line, no traceback."""
