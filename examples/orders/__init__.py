"""The orders example: the seed's story as a durable workflow with a saga.

Authorize the payment, reserve the inventory, wait (a durable timer: 24 h in production,
seconds in the demo), capture the payment and send the receipt through the outbox; a failed
capture unwinds (release the inventory, cancel the authorization). Run
``python -m examples.orders`` (embedded: SQLite store + filesystem broker) or
``python -m examples.orders --server --break-it`` (PostgreSQL + Redis, workers, beats and
relays SIGKILLed and SIGSTOPped at random).
"""
