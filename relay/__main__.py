"""``python -m relay``: the same as the ``sfchat-relay`` command."""

import sys

from relay.cli import main

sys.exit(main())
