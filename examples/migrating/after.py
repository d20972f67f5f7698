"""The same app on reliable_beat (the "after"). The whole diff:

1. ``beat_scheduler`` and ``reliable_beat_database_url`` (the app's own database, so the
   effect and the idempotency key commit together);
2. ``base=IdempotentTask, bind=True`` and writing the effect through ``self.transaction()``;
3. the e-mail moves into the outbox; ``celery -A shop reliable-beat relay`` sends it, with a
   ``Message-ID`` derived from the outbox row, at least once and never lost.
"""

from __future__ import annotations

from celery import Celery
from celery.schedules import crontab
from sqlalchemy import text

from reliable_beat import IdempotentTask

app = Celery("shop", broker="redis://localhost:6379/0")
app.conf.beat_schedule = {
    "nightly-invoices": {"task": "shop.send_invoices", "schedule": crontab(minute=0, hour=2)},
}
app.conf.beat_scheduler = "reliable_beat.ReliableScheduler"  # (1)
app.conf.reliable_beat_database_url = "postgresql+psycopg://shop@localhost/shop"  # (1)


@app.task(name="shop.send_invoices", base=IdempotentTask, bind=True)  # (2)
def send_invoices(self: IdempotentTask) -> None:
    with self.transaction() as tx:  # (2) one transaction: effect + key + outbox
        tx.execute(text("INSERT INTO invoices (day) VALUES (current_date)"))
        self.outbox.add(  # (3)
            tx, "smtp", {"to": "billing@example.com", "subject": "invoices",
                         "text": "invoices are out"},
        )
