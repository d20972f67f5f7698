"""A Celery app whose webhook destination reads its token from ``RB_TEST_HOOK_TOKEN``, and
whose task ``secret_app.charge`` is given secrets and fails quoting them.

``RB_SECRET_BROKER_URL`` (default ``memory://``) and ``RB_SECRET_DB_URL`` (the store, when
set) let a real ``celery worker`` run the task (tests/acceptance/test_secret_leaks.py).
"""

from __future__ import annotations

import os

from celery import Celery

from reliable_beat.celery.task import IdempotentTask
from reliable_beat.errors import PermanentError

app = Celery("secret_app", broker=os.environ.get("RB_SECRET_BROKER_URL", "memory://"),
             set_as_current=False)
app.conf.reliable_beat_webhook_destinations = {
    "billing": {"base_url": "https://billing.example",
                "headers": {"Authorization": {"env": "RB_TEST_HOOK_TOKEN"}}},
}
if os.environ.get("RB_SECRET_DB_URL"):
    app.conf.reliable_beat_database_url = os.environ["RB_SECRET_DB_URL"]
app.conf.broker_connection_retry_on_startup = True


@app.task(base=IdempotentTask, bind=True, name="secret_app.charge")
def charge(self: IdempotentTask, customer: str, *, key: str, api_key: str) -> None:
    """Fails for good, quoting its credentials as a careless client library does."""
    raise PermanentError(
        f"billing refused customer={customer}: key={key} api_key={api_key} "
        f"headers={{'Authorization': 'Bearer {api_key}'}} (idempotency key: "
        f"{self.idempotency_key})")
