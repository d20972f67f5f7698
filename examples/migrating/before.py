"""A stock-beat app, as many run today (the "before" of the migration example).

Two beats send every slot twice; one beat down at 02:00 means the 02:00 run never happens;
the e-mail is sent from inside the task, so a retry sends it twice.
"""

from __future__ import annotations

import smtplib
from email.message import EmailMessage

from celery import Celery
from celery.schedules import crontab
from sqlalchemy import create_engine, text

app = Celery("shop", broker="redis://localhost:6379/0")
app.conf.beat_schedule = {
    "nightly-invoices": {"task": "shop.send_invoices", "schedule": crontab(minute=0, hour=2)},
}
engine = create_engine("postgresql+psycopg://shop@localhost/shop")


@app.task(name="shop.send_invoices")
def send_invoices() -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO invoices (day) VALUES (current_date)"))
    msg = EmailMessage()
    msg["To"] = "billing@example.com"
    msg.set_content("invoices are out")
    with smtplib.SMTP("localhost") as smtp:  # a direct side effect: at least once, not once
        smtp.send_message(msg)
