"""The chat screen on a person's own machine, driving a head that runs elsewhere, through the relay.

``host.ChatHost`` offers a head's runtime (``sfchat --offer-chat``, in a notebook that can only
dial out) to one chat client at a time under a relay session of its own, paired by a code it
prints, sealed end to end and resumed exactly as head and tail are (``sfchat.link``).
``client.RemoteRuntime`` is the runtime the chat screen drives at home (``sfchat --remote``):
no torch, no model. ``outbox.Outbox`` is what each side sent and the other has not acknowledged,
so that a reconnect of either loses and repeats nothing. The messages are
``sfchat.protocol.chat``'s. Torch-free.
"""
