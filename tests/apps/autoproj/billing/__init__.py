"""An app package whose ``tasks`` module ``autodiscover_tasks`` imports."""
