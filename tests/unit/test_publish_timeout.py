"""``reliable_beat_publish_timeout_seconds``: the bound on a publish's wait on a hung broker
(the real hang is proven in tests/acceptance/test_broker_hang.py)."""

from __future__ import annotations

import pytest
from celery import Celery

from reliable_beat.celery.publishing import bound_broker_wait
from reliable_beat.errors import ConfigurationError
from reliable_beat.settings import Settings


def test_default_and_validation() -> None:
    assert Settings(database_url="sqlite://").publish_timeout_seconds == 10.0
    with pytest.raises(ConfigurationError, match="reliable_beat_publish_timeout_seconds"):
        Settings(database_url="sqlite://", publish_timeout_seconds=0)


def test_redis_broker_gets_the_socket_timeout_when_unset() -> None:
    app = Celery("t", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.broker_transport_options = {"visibility_timeout": 7200}
    assert bound_broker_wait(app, 4.0) is True
    assert app.conf.broker_transport_options == {"visibility_timeout": 7200,
                                                 "socket_timeout": 4.0}
    assert app.connection_for_write().transport_options["socket_timeout"] == 4.0


def test_the_users_socket_timeout_wins() -> None:
    app = Celery("t", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.broker_transport_options = {"socket_timeout": 30}
    assert bound_broker_wait(app, 4.0) is False
    assert app.conf.broker_transport_options == {"socket_timeout": 30}


def test_other_transports_untouched() -> None:
    app = Celery("t", broker="memory://", set_as_current=False)
    assert bound_broker_wait(app, 4.0) is False
    assert not app.conf.broker_transport_options
