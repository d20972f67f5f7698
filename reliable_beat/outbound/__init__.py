"""The built-in outbox handlers that deliver outside the framework: ``webhook`` (HTTP) and
``smtp`` (e-mail).

:mod:`reliable_beat.handlers` registers them (:func:`~reliable_beat.handlers.load_handlers`)
and re-exports their public names; their configuration is :mod:`reliable_beat.destinations`.

* :mod:`reliable_beat.outbound.base`: the delivery result and the errors that steer the relay;
* :mod:`reliable_beat.outbound.webhook`: :class:`~reliable_beat.outbound.webhook.WebhookHandler`;
* :mod:`reliable_beat.outbound.smtp`: :class:`~reliable_beat.outbound.smtp.SmtpHandler`.
"""
