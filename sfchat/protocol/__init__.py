"""What head and tail say to each other: the binary wire format, the typed HELLO/READY handshake
and the typed PROGRESS/ERROR messages. Torch-free; imports nothing of sfchat but ``UserError``."""
