"""What the nodes say to each other: the binary wire format (``wire``), the typed HELLO/READY
handshake (``handshake``) and PROGRESS/ERROR messages (``messages``) of head and tail, the chat
protocol of a chat screen and the head it drives (``chat``, its events in ``chat_events``), and the
field checks they share (``fields``). Torch-free; imports nothing of sfchat outside this package but the
events, ``params`` and ``plaintext``."""
