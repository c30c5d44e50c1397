"""The pure core: job states, the delivery policy, job ids and the wire message.

Nothing in this package performs I/O or imports from storage, transport, api or cli.
"""
