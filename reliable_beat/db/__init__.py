"""SQL store: tables, dialect quirks, hot statements and migrations."""
